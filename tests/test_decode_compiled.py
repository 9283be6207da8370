"""The decoding step's body through torch.compile (core/infer/decode_step.py), as CUDA runs
it before capturing it, here with Inductor's CPU code: not in the quick set (its compilation
takes seconds)."""

from __future__ import annotations

import pytest
import torch

from test_decode_graph import _buffered, tiny  # noqa: F401 - tiny: the fixture, by its name


def test_the_compiled_step_is_one_graph_compiled_once_with_the_same_tokens(tiny):  # noqa: F811 - the fixture
    """The step's body through torch.compile (what CUDA decodes with; here Inductor's CPU code),
    its projections fused as `weft generate` fuses them (strategies/model/fused_linears.py):
    one trace over the whole forward, no graph break (the cache's decode write and attention
    traced with it, the fusing hooks too), compiled at the first step and never again over the
    tokens after it, and transformers' generate's tokens and log-probabilities."""
    import copy

    from torch._dynamo.utils import counters

    from weft.plugins.models.families import QWEN2_5_VL

    model = copy.deepcopy(tiny["model"])
    text = model.config.get_text_config().num_hidden_layers
    assert QWEN2_5_VL.fuse_projections(model) == 2 * text + model.config.vision_config.depth
    torch._dynamo.reset()
    counters.clear()
    tokens, logprobs, report = _buffered({**tiny, "model": model}, compile=True)
    assert report["step_compiled"] and report["step_compile_s"] > 0 and "step_compile_off" not in report
    assert report["first_step_s"] == report["step_compile_s"]  # the compilation is the first step's
    assert report["step_graphs"] == 1 and report["step_graph_breaks"] == 0 and "step_graph_break" not in report
    assert tokens == tiny["tokens"] and logprobs == pytest.approx(tiny["logprobs"], abs=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 100
    torch._dynamo.reset()


def test_the_compiled_sampled_step_draws_what_the_eager_one_draws(tiny):  # noqa: F811 - the fixture
    """Sampling through the compiled body: the uniform draws are filled outside it, the nucleus
    chosen inside; the same seed gives the eager step's tokens (and log-probabilities)."""
    from weft.core.infer.sampling import Sampling

    def sampled(compile):
        sampling = Sampling(temperature=0.9, top_p=0.8, generator=torch.Generator().manual_seed(3))
        tokens, logprobs, report = _buffered(tiny, sampling=sampling, compile=compile)
        return tokens, logprobs, report

    torch._dynamo.reset()
    tokens, logprobs, report = sampled(True)
    want, want_logprobs, _ = sampled(False)
    assert report["step_compiled"] and tokens == want and logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert tokens != tiny["tokens"]  # not the greedy answer
    torch._dynamo.reset()


def test_a_graph_break_in_the_step_is_reported(tiny):  # noqa: F811 - the fixture
    """A step that does not trace whole still decodes (the same tokens), and says so: how many
    graph breaks, the first one's reason, the graphs compiled (its JSON, the summary line)."""
    layer = tiny["model"].model.language_model.layers[0]

    def breaks(module, args):
        torch._dynamo.graph_break()

    torch._dynamo.reset()
    handle = layer.register_forward_pre_hook(breaks)
    try:
        tokens, logprobs, report = _buffered(tiny, compile=True)
    finally:
        handle.remove()
        torch._dynamo.reset()
    assert tokens == tiny["tokens"] and logprobs == pytest.approx(tiny["logprobs"], abs=1e-5)
    assert report["step_graph_breaks"] >= 1 and report["step_graphs"] >= 2, report
    assert "graph_break" in report["step_graph_break"], report


def test_the_compiled_bf16_step_rounds_as_the_eager_one(tiny):  # noqa: F811 - the fixture
    """In bf16 the compiled step keeps eager's roundings (Inductor's emulate_precision_casts):
    the eager step's tokens and log-probabilities to 1e-9 (fused without them: 2e-3 apart on this
    model, and the 7B's widths part in tokens by the second one)."""
    import copy

    half = {**tiny, "model": copy.deepcopy(tiny["model"]).to(torch.bfloat16)}
    torch._dynamo.reset()
    tokens, logprobs, report = _buffered(half, compile=True)
    want, want_logprobs, _ = _buffered(half, compile=False)
    torch._dynamo.reset()
    assert report["step_compiled"] and report["step_graph_breaks"] == 0
    assert tokens == want and logprobs == pytest.approx(want_logprobs, abs=1e-9, rel=0)


@pytest.mark.parametrize("positions", [[100, 57], [100]], ids=["a-position-a-row", "one-for-every-row"])
def test_the_compiled_cache_write_touches_one_row_not_the_whole_cache(positions):
    """A decoding step's cache write through Inductor: each row's token written into the buffer
    itself. A scatter there (the write before 2026-12-02) became a copy of the whole layer's
    cache, the row written into the copy, and the copy written back: at 128K ~1 GB a layer a
    token, more than the weights' own read. The generated code names no loop over the buffer."""
    from torch._inductor.utils import run_and_get_code

    from weft.plugins.kv_cache.static import StaticLayer

    state = {"phase": "prefill", "capacity": 4096, "rows": 2, "row": 0, "position": None, "length": 0, "start": 0,
             "prompt": 0, "splits": 1, "plan": None}
    layer = StaticLayer(state=state)
    prompt = torch.randn(1, 2, 100, 16)
    for row in (0, 1):
        state["row"] = row
        layer.update(prompt, prompt.clone())
    state.update(phase="decode", position=torch.tensor(positions))
    new = torch.randn(2, 2, 1, 16)  # (B, Hkv, 1, D)
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(lambda k, v: layer.update(k, v)), new, new * 2)
    torch._dynamo.reset()
    second = positions[-1]  # row 1's position
    assert torch.equal(layer.keys[0, :, 100], new[0, :, 0])
    assert torch.equal(layer.values[1, :, second], 2 * new[1, :, 0])
    assert torch.equal(layer.keys[0, :, :100], prompt[0]) and not layer.keys[0, :, 101:].any()
    assert code and not any(f"{layer.keys.numel()}L" in c for c in code), code
