"""The greedy step from device buffers (core/infer/decode_graph.py), as it runs where no
CUDA graph is captured (the CPU): the tiny Qwen2.5-VL with an image over the static cache
gives transformers' generate's tokens and log-probabilities, and the eager loop's
(``decode_greedy``, host positions); it stops at a stop token inside a read-back.

That the step is capturable, checked without a GPU: it reads nothing back from the device
(it runs on the meta device, where every read of a tensor's value to the host raises:
``.item()``, ``int()``, ``bool()``, ``.tolist()``, ``.cpu()``), and the host decides nothing
per token (two consecutive steps dispatch the same operators with the same shapes and the
same scalar arguments, so one captured step is every step)."""

from __future__ import annotations

import copy
import io
import pathlib
import types

import pytest
import torch
from PIL import Image

from weft.core.infer import decode
from weft.core.infer.decode_graph import capture_blocker, decode_buffered
from weft.core.infer.decode_step import DecodeStep
from weft.core.infer.sampling import nucleus_from_noise

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT = "What colour is this picture, and why?"
NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model, its prompt with an image, and transformers' greedy answer."""
    from model_helpers import transformers_greedy

    image = tmp_path_factory.mktemp("graph") / "red.png"
    buffer = io.BytesIO()
    Image.new("RGB", (84, 56), (200, 30, 30)).save(buffer, format="PNG")
    image.write_bytes(buffer.getvalue())
    found = transformers_greedy(str(ROOT / "recipes" / "tiny-vl.toml"), prompt=PROMPT, image=str(image), new=NEW)
    model = found["model"]
    return {**found, "attention": model.config.get_text_config()._attn_implementation}


def _prefilled(tiny):
    """A static cache holding the prompt; the first token and its log-probability."""
    from weft.plugins.kv_cache.static import StaticCache

    model, inputs = tiny["model"], tiny["inputs"]
    length = inputs["input_ids"].shape[1]
    decode.text_attention(model, tiny["attention"])  # the prefill's own, not an earlier cache's decode attention
    cache = StaticCache(num_layers=model.config.get_text_config().num_hidden_layers)
    cache.reserve(length + NEW)
    cache.begin_prefill(keep=None, prompt=length)
    with torch.no_grad():
        logits = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].double()
    cache.begin_decode()
    decode.text_attention(model, cache.decode_attention)
    token = int(logits.argmax())
    return cache, [token], [float(torch.log_softmax(logits, dim=-1)[0, token])]


def _buffered(tiny, *, stops=frozenset(), read_every=decode.READ_EVERY, sampling=None, compile=False):
    cache, tokens, logprobs = _prefilled(tiny)
    rotary = decode.next_rotary(tiny["inputs"], positions_of=tiny["family"].positions(tiny["model"]))
    with torch.no_grad():
        report = decode_buffered(tiny["model"], cache=cache, tokens=tokens, logprobs=logprobs,
                                 row=tiny["inputs"]["input_ids"].shape[1], rotary=rotary,
                                 max_new_tokens=NEW, stops=set(stops), device=torch.device("cpu"),
                                 show=None, capture=True, read_every=read_every, sampling=sampling,
                                 compile=compile)
    return tokens, logprobs, report


def test_equals_transformers_generate_and_the_eager_loop(tiny):
    import torch.distributed as dist

    tokens, logprobs, report = _buffered(tiny)
    first = report.pop("first_step_s")  # the first step timed apart (its one-time work: no token's cost)
    assert first > 0 and report == {"cuda_graph": False, "graph_pool_bytes": 0, "cuda_graph_off": "decoding on cpu",
                                    "decode_steps": NEW - 1, "step_compiled": False}
    assert len(tiny["tokens"]) == NEW and tokens == tiny["tokens"]
    assert logprobs == pytest.approx(tiny["logprobs"], abs=1e-5)
    # The eager loop over the same cache (host positions, the model numbering the tokens).
    cache, eager, eager_logprobs = _prefilled(tiny)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.no_grad():
            decode.decode_greedy(tiny["model"], cache=cache, tokens=eager, logprobs=eager_logprobs,
                                 length=tiny["inputs"]["input_ids"].shape[1], max_new_tokens=NEW, stops=set(),
                                 device=torch.device("cpu"), show=None)
    finally:
        dist.destroy_process_group()
    assert tokens == eager and logprobs == pytest.approx(eager_logprobs, abs=1e-12)


def test_a_stop_inside_a_read_back_ends_the_answer(tiny):
    stop = tiny["tokens"][4]
    first = tiny["tokens"].index(stop)
    tokens, logprobs, _ = _buffered(tiny, stops={stop}, read_every=3)
    assert tokens == tiny["tokens"][:first + 1] and len(logprobs) == len(tokens)


def _step_on(tiny, device: str) -> DecodeStep:
    """A step after the prefill, with the model, the cache and the buffers on ``device``."""
    cache, tokens, _ = _prefilled(tiny)
    model = tiny["model"]
    if device == "meta":
        model = copy.deepcopy(model).to("meta")  # its own config too: the decode attention set as it was
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to("meta"), layer.values.to("meta")
    rotary = decode.next_rotary(tiny["inputs"], positions_of=tiny["family"].positions(tiny["model"]))
    length = tiny["inputs"]["input_ids"].shape[1]
    return DecodeStep(model, cache=cache, token=torch.tensor([[tokens[0]]], device=device),
                      rotary=rotary.to(device), row=torch.tensor([length], device=device), capture=False)


def test_the_step_reads_nothing_back_from_the_device(tiny):
    """On the meta device a tensor has no values: a step that read one to the host would raise."""
    with pytest.raises(RuntimeError):
        torch.zeros(1, device="meta").item()  # the premise
    step = _step_on(tiny, "meta")
    with torch.no_grad():
        for _ in range(2):
            chosen, logprob = step()
    assert chosen.device.type == "meta" and chosen.shape == (1,) and logprob.dtype == torch.float64


def test_every_step_dispatches_the_same_operators(tiny):
    """Two consecutive steps on the CPU: the same operators, shapes and scalar arguments, and no
    value read back (``_local_scalar_dense``: ``.item()``, ``int()``, ``bool()``, indexing)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    class Trace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            def describe(x):
                return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x

            self.ops.append((func, repr(tree_map(describe, (args, kwargs or {})))))
            return func(*args, **(kwargs or {}))

    step = _step_on(tiny, "cpu")
    traces = []
    with torch.no_grad():
        for _ in range(2):
            with Trace() as trace:
                step()
            traces.append(trace.ops)
    assert len(traces[0]) > 100  # the whole forward was seen
    assert not [f for f, _ in traces[0] if f is torch.ops.aten._local_scalar_dense.default]
    assert traces[0] == traces[1]


def test_warm_up_then_one_capture_then_replays(tiny):
    """The order on CUDA, with the CUDA parts stood in for: WARMUP eager steps, one capture
    (which runs nothing, so that step's replay follows at once), then a replay per token;
    the tokens are the eager step's."""
    from weft.core.infer.decode_step import WARMUP

    calls = []

    class Staged(DecodeStep):
        def _warm(self):
            calls.append("warm")
            self._step()

        def _record(self):
            calls.append("record")
            self.graph = types.SimpleNamespace(replay=self._step)  # what the capture recorded

        def _replay(self):
            calls.append("replay")
            self.graph.replay()
            self.replays += 1

    eager = _step_on(tiny, "cpu")
    with torch.no_grad():
        eager_tokens = [int(eager()[0]) for _ in range(5)]
        plain = _step_on(tiny, "cpu")  # a fresh prefill: the model's decode attention is this cache's
        staged = Staged(tiny["model"], cache=plain.cache, token=plain.token, rotary=plain.rotary, row=plain.row,
                        capture=True)
        staged_tokens = [int(staged()[0]) for _ in range(5)]
    assert calls == ["warm"] * WARMUP + ["record", "replay"] + ["replay"] * (4 - WARMUP)
    assert staged_tokens == eager_tokens == tiny["tokens"][1:6] and staged.replays == 5 - WARMUP


def test_what_keeps_a_step_from_being_captured(tiny):
    from transformers import DynamicCache

    from weft.plugins.kv_cache.static import StaticCache

    model, cuda = tiny["model"], torch.device("cuda")  # a device object only: nothing runs
    static = StaticCache(num_layers=1)
    assert capture_blocker(model, cache=static, device=cuda, world=1) is None
    assert capture_blocker(model, cache=static, device=torch.device("cpu"), world=1) == "decoding on cpu"
    assert "2 ranks" in capture_blocker(model, cache=static, device=cuda, world=2)
    assert "DynamicCache" in capture_blocker(model, cache=DynamicCache(), device=cuda, world=1)
    config = model.config.get_text_config()
    saved = dict(config.rope_parameters)
    config.rope_parameters = {**saved, "rope_type": "dynamic", "factor": 2.0}
    try:
        assert "dynamic rotary embedding" in capture_blocker(model, cache=static, device=cuda, world=1)
    finally:
        config.rope_parameters = saved


def test_rows_of_a_batch_stop_on_their_own(monkeypatch):
    """Each row keeps its tokens up to its own stop (the steps after it dropped), the others
    go on; the loop ends at the read-back where the last row stops, not at max_new_tokens."""
    from weft.core.infer import decode_graph

    script = [[5, 7], [9, 7], [2, 8], [4, 2], [6, 6], [6, 6], [6, 6], [6, 6]]  # step -> (row 0, row 1)

    class Scripted:
        def __init__(self, *args, **kwargs):
            self.steps, self.graph, self.error, self.compiled, self.compile_error = 0, None, None, False, None
            self.first_s = None

        def __call__(self):
            self.steps += 1
            return torch.tensor(script[self.steps - 1]), torch.full((2,), -0.5, dtype=torch.float64)

    monkeypatch.setattr(decode_graph, "DecodeStep", Scripted)
    tokens, logprobs = [[1], [1]], [[-0.1], [-0.1]]
    report = decode_graph.decode_rows_buffered(
        torch.nn.Linear(1, 1), cache=None, tokens=tokens, logprobs=logprobs, rows=[4, 6],
        rotary=torch.zeros(2, 1, dtype=torch.long), max_new_tokens=9, stops={2}, device=torch.device("cpu"),
        show=None, capture=False, read_every=2)
    assert tokens == [[1, 5, 9, 2], [1, 7, 7, 8, 2]]
    assert logprobs == [[-0.1, -0.5, -0.5, -0.5], [-0.1, -0.5, -0.5, -0.5, -0.5]]
    assert report["decode_steps"] == 4 and report["cuda_graph_off"] == "--no-cuda-graph"


def test_a_read_back_in_the_checked_warm_up_step_decodes_eagerly(tiny, monkeypatch):
    """The last warm-up step runs under torch's synchronisation check (CUDA's, stood in for
    here): a read-back there is named by its line, the step runs again unchecked, and every
    later step is eager; the tokens are the eager loop's all the same."""
    import contextlib

    modes = []

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    class ReadsBack(DecodeStep):
        def _step(self):
            if modes[-1:] == ["error"]:
                modes.append("raised")
                raise RuntimeError("called a synchronizing CUDA operation")
            super()._step()

        def _record(self):
            raise AssertionError("a step that reads back is never captured")

    eager = _step_on(tiny, "cpu")
    with torch.no_grad():
        eager_tokens = [int(eager()[0]) for _ in range(5)]
        plain = _step_on(tiny, "cpu")
        step = ReadsBack(tiny["model"], cache=plain.cache, token=plain.token, rotary=plain.rotary, row=plain.row,
                         capture=True)
        tokens = [int(step()[0]) for _ in range(5)]
    assert tokens == eager_tokens and modes == ["error", "raised", "default"]
    assert not step.capture and "reads back from the device at" in step.error and "test_decode_graph.py" in step.error


def test_nucleus_draws_follow_the_nucleus():
    """``nucleus_from_noise`` over 40,000 rows of the same logits: tokens outside the top-p
    nucleus never come, the others as often as their renormalised probabilities say (within
    4 standard deviations); a tiny temperature is the argmax."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(40_000, 6)
    noise = torch.rand(40_000, 6, generator=torch.Generator().manual_seed(0))
    drawn = nucleus_from_noise(logits, noise, temperature=0.7, top_p=0.9)
    probs = torch.softmax(logits[0] / 0.7, dim=-1)
    nucleus = int((probs.sort(descending=True).values.cumsum(0) - probs.sort(descending=True).values < 0.9).sum())
    want = torch.zeros(6)
    want[:nucleus] = probs[:nucleus] / probs[:nucleus].sum()  # the logits are in descending order already
    counts = torch.bincount(drawn, minlength=6).double() / 40_000
    assert counts[nucleus:].sum() == 0 and 1 < nucleus < 6
    sigma = (want * (1 - want) / 40_000).sqrt()
    assert ((counts - want).abs() <= 4 * sigma + 1e-12).all(), (counts, want)
    assert (nucleus_from_noise(logits, noise, temperature=1e-4, top_p=1.0) == 0).all()


def test_sampled_steps_are_the_loop_that_draws_the_same_noise(tiny):
    """Sampling in the buffered step (uniform draws from a seeded generator filled before each
    step, nucleus on the device) gives what a plain loop over the eager step with the same
    draws gives; the log-probabilities are the model's (before the temperature)."""
    import torch.distributed as dist

    from weft.core.infer.sampling import Sampling

    sampling = Sampling(temperature=0.9, top_p=0.8, generator=torch.Generator().manual_seed(3))
    tokens, logprobs, _ = _buffered(tiny, sampling=sampling)
    cache, want, want_logprobs = _prefilled(tiny)
    generator, length = torch.Generator().manual_seed(3), tiny["inputs"]["input_ids"].shape[1]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.no_grad():
            while len(want) < NEW:
                position = length + len(want) - 1
                logits = decode.decode_step(tiny["model"], cache=cache, token=torch.tensor([[want[-1]]]),
                                            position=position, cache_position=torch.tensor([position])).logits[:, -1]
                noise = torch.rand(logits.shape, generator=generator)
                token = int(nucleus_from_noise(logits.float(), noise, temperature=0.9, top_p=0.8)[0])
                want.append(token)
                want_logprobs.append(float(torch.log_softmax(logits.double(), dim=-1)[0, token]))
    finally:
        dist.destroy_process_group()
    assert tokens == want and logprobs == pytest.approx(want_logprobs, abs=1e-9)
    assert tokens != tiny["tokens"]  # not the greedy answer


def test_the_bytes_a_step_reads(tiny):
    """The weights a decoding step reads: every parameter but the vision tower's and the input
    embedding's (one row of it a step), the output head's whole matrix even where it is tied."""
    model = tiny["model"]
    visual, embed = model.model.visual, model.get_input_embeddings()
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    tower = sum(p.numel() * p.element_size() for p in visual.parameters())
    table = embed.weight.numel() * embed.weight.element_size()
    tied = model.get_output_embeddings().weight is embed.weight
    assert decode.weight_bytes(model, skip=[visual, embed]) == every - tower - (0 if tied else table)
    assert decode.weight_bytes(model, skip=[]) == every
