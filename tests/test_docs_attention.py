"""docs/attention.md's contract, found by recording the calls of real runs, and its example
strategy (examples/sliding_window) run on the tiny Qwen2.5-VL model against SDPA."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest
import torch

from weft.core.hookspecs import hookimpl
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import Recipe
from weft.core.registry import AttentionBinding, NoParams, Strategy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example():
    path = ROOT / "examples" / "sliding_window" / "sliding_window.py"
    spec = importlib.util.spec_from_file_location("sliding_window", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_run(tmp_path: pathlib.Path, *, rules: str = "", extra=(), batching: str = "", steps: int = 2) -> list[dict]:
    """A one-rank CPU run of the tiny Qwen2.5-VL model: its metrics rows."""
    from weft.core.train.loop import train

    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe_path = tmp_path / "run.toml"
    recipe_path.write_text(
        '[model]\npreset = "qwen2_5_vl_tiny"\n'
        '[data]\nnum_samples = 16\nmax_side = 56\n'
        f"[train]\nmax_steps = {steps}\nmicro_batch_tokens = 512\n"
        '[parallel]\nnproc = 1\ndevice = "cpu"\n' + rules + batching
    )
    pm = build_plugin_manager(extra=list(extra), entry_points=False)
    train(recipe=Recipe.from_toml(recipe_path), pm=pm, run_dir=tmp_path / "run", resume=False, console=False)
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


class Recorder:
    """An attention strategy ``record`` that runs transformers' SDPA and keeps what each call got."""

    def __init__(self, name: str = "record_attention"):
        self.name, self.calls = name, []

    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="attention", name="record", params=NoParams, summary="SDPA, recorded")]

    @hookimpl
    def weft_attention(self, decision):
        if decision.strategy != "record":
            return None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def attention(module, query, key, value, attention_mask, **kwargs):
            out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
            self.calls.append({"module": type(module).__name__, "query": tuple(query.shape),
                               "key": tuple(key.shape), "value": tuple(value.shape), "mask": attention_mask,
                               "kwargs": dict(kwargs), "out": tuple(out.shape), "weights": weights,
                               "is_causal": getattr(module, "is_causal", None)})
            return out, weights

        return AttentionBinding(name=self.name, fn=attention)


RECORD_ALL = '[[rules]]\nattention = { strategy = "record" }\n'
PACK = '[[rules]]\nbatching = { strategy = "token_budget", pack = true }\n'


def test_what_an_attention_function_receives(tmp_path):
    """Every fact docs/attention.md states about the arguments, on a padded batch of the tiny model."""
    recorder = Recorder()
    tiny_run(tmp_path, rules=RECORD_ALL, extra=[("recorder", recorder)], steps=1)
    text = [c for c in recorder.calls if c["module"] == "Qwen2_5_VLAttention"]
    vision = [c for c in recorder.calls if c["module"] == "Qwen2_5_VLVisionAttention"]
    assert text and vision
    for call in text:
        b, hq, s, d = call["query"]
        assert (hq, d) == (4, 16) and call["key"] == call["value"] == (b, 2, s, d)  # KV heads: GQA is ours
        assert call["out"] == (b, s, hq, d) and call["weights"] is None
        assert call["mask"] is None and call["is_causal"] is True  # padded rows, yet no mask
        assert {"dropout", "scaling", "position_ids", "sliding_window", "use_cache"} <= set(call["kwargs"])
        assert call["kwargs"]["dropout"] == 0.0 and call["kwargs"]["scaling"] == pytest.approx(d ** -0.5)
        assert call["kwargs"]["position_ids"] is None and call["kwargs"]["sliding_window"] is None
    assert any(c["query"][0] > 1 for c in text)  # several padded rows in one micro-batch
    for call in vision:  # one call per window or image, without "flash" in the name
        b, h, s, d = call["query"]
        assert b == 1 and call["key"] == call["query"] and call["out"] == (1, s, h, d)
        assert call["mask"] is None and call["kwargs"]["is_causal"] is False and "cu_seq_lens_q" not in call["kwargs"]


def test_a_flash_name_changes_the_vision_calls(tmp_path):
    recorder = Recorder(name="record_flash_attention")
    tiny_run(tmp_path, rules=RECORD_ALL, extra=[("recorder", recorder)], steps=1)
    vision = [c for c in recorder.calls if c["module"] == "Qwen2_5_VLVisionAttention"]
    assert vision
    for call in vision:  # one call per block: every patch, the windows as cu_seq_lens
        cu = call["kwargs"]["cu_seq_lens_q"]
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == call["query"][2]
        assert {"cu_seq_lens_k", "max_length_q", "max_length_k"} <= set(call["kwargs"])


def test_packed_documents_arrive_as_doc_ids(tmp_path):
    recorder = Recorder()
    tiny_run(tmp_path, rules=RECORD_ALL, extra=[("recorder", recorder)], batching=PACK, steps=1)
    text = [c for c in recorder.calls if c["module"] == "Qwen2_5_VLAttention"]
    assert text
    for call in text:
        docs = call["kwargs"]["weft_doc_ids"]
        assert call["query"][0] == 1 and docs.shape == (1, call["query"][2]) and call["mask"] is None
        assert int(docs.max()) > 0  # several documents in the row


def _band_reference(q, k, v, *, window):
    """Float64 loop: each query row's softmax over the keys its window allows."""
    heads, kv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    out = torch.zeros_like(q)
    for i in range(q.shape[2]):
        lo = max(0, i - window + 1)
        scores = q[:, :, i : i + 1] @ k[:, :, lo : i + 1].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out[:, :, i] = (scores.softmax(-1) @ v[:, :, lo : i + 1])[:, :, 0]
    return out.transpose(1, 2)


@pytest.mark.quick
@pytest.mark.parametrize("window", [1, 3, 64])
def test_the_example_function_is_a_causal_band(window):
    example = load_example()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 20, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out, weights = example.sliding_window_attention(torch.nn.Module(), q, k, v, None, window=window)
    assert weights is None and out.shape == (2, 20, 4, 8)
    torch.testing.assert_close(out, _band_reference(q, k, v, window=window))


def test_the_example_strategy_equals_sdpa_where_the_window_covers_the_sequence(tmp_path):
    example = load_example()
    text_rule = '[[rules]]\nwhen = { modality = "text" }\nattention = { strategy = "sliding_window", window = %d }\n'
    sdpa = tiny_run(tmp_path / "sdpa")
    whole = tiny_run(tmp_path / "whole", rules=text_rule % 100_000, extra=[("sliding_window", example)])
    narrow = tiny_run(tmp_path / "narrow", rules=text_rule % 2, extra=[("sliding_window", example)])
    for ours, theirs in zip(whole, sdpa, strict=True):  # the second step: after one update from equal gradients
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    assert abs(narrow[0]["loss"] - sdpa[0]["loss"]) > 1e-3  # a short window does change the model


@pytest.mark.quick
def test_the_example_strategy_refuses_a_vision_tower(tmp_path):
    from weft.core.errors import PlanError
    from weft.core.mesh_spec import MeshSpec
    from weft.core.recipe.rule_engine import ModuleInfo, build_plan

    example = load_example()
    pm = build_plugin_manager(extra=[("sliding_window", example)], entry_points=False)
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"},
                               "rules": [{"attention": {"strategy": "sliding_window", "window": 8}}]})
    modules = [ModuleInfo(path="", class_name="Root", kind="root"),
               ModuleInfo(path="visual.blocks.0.attn", class_name="Attn", kind="attention", modality="vision")]
    with pytest.raises(PlanError, match="causal, for text modules"):
        build_plan(recipe=recipe, modules=modules, registry=pm.registry, mesh=MeshSpec(), world_size=1)


def _record_under_ring(rank: int, world: int) -> None:
    import attention_recorder
    from distributed import sp_model
    from weft.core.train.step import shard_micro_batch
    from weft.strategies.data.conversation import collate, encode_conversation, load_processor
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    model, _, plan, mesh, split = sp_model({
        "model": {"preset": "qwen2_5_vl_tiny"}, "parallel": {"ring": world},
        "rules": [{"when": {"modality": "text"}, "attention": {"strategy": "record_ring"}}],
    }, rank=rank, world=world, plugins=("attention_recorder",))
    tokenizer, image_processor = load_processor("tiny_vl")
    samples = [encode_conversation(c.messages, tokenizer=tokenizer, image_processor=image_processor)
               for c in synthetic_conversations(seed=5, num_samples=2, min_side=28, max_side=56)]
    batch = collate(samples, pad_id=tokenizer.pad_token_id, pad_to_multiple_of=split.multiple)
    batch["weft_doc_ids"] = torch.zeros_like(batch["input_ids"])  # one document a row, as packing would say
    local = shard_micro_batch(batch, split)
    model(**{k: v for k, v in local.items() if k not in ("labels", "shift_labels")}, use_cache=False)
    b, s = batch["input_ids"].shape
    assert s % split.multiple == 0 and split.multiple == 2 * world  # zigzag: 2 chunks a rank
    text = [c for c in attention_recorder.CALLS if c["module"] == "Qwen2_5_VLAttention"]
    assert len(text) == 2  # one per layer, on every rank
    for call in text:
        assert call["query"] == (b, 4, s // world, 16) and call["key"] == (b, 2, s // world, 16)
        assert call["mask"] is None and call["kwargs"]["position_ids"] is None
        assert tuple(call["kwargs"]["weft_doc_ids"].shape) == (b, s)  # the whole sequence's


def test_under_sequence_parallelism_each_rank_sees_its_part():
    """docs/attention.md, "Sequence parallelism": ring 2, zigzag. Each rank's query and key hold
    its part of the sequence; the document ids arrive whole."""
    from distributed import run_ranks

    run_ranks(2, _record_under_ring)
