"""torch.compile by rule: inside each unit, every child but the attention, names unchanged.

Inductor's numbers on the GPU are covered by the training benchmark's loss curve;
here the trace itself (aot_eager: dynamo + AOT autograd, no code generation, so
quick on two cores) must keep gradients, under activation checkpointing too."""

from __future__ import annotations

import copy

import pytest
import torch

from model_helpers import build_model
from weft.core.recipe import Recipe
from weft.strategies.memory.activation_checkpoint import apply_checkpointing
from weft.strategies.memory.compile_units import compile_unit


@pytest.mark.parametrize(("mode", "attention"), [("off", False), ("full", False), ("mlp", False),
                                               ("except_attention", False), ("off", True), ("except_attention", True)])
def test_compiled_children_keep_gradients(mode, attention):
    """Gradients unchanged, the attention compiled or not; under except_attention the attention
    kernel's kept outputs are found again when the compiled attention is recomputed."""
    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        apply_checkpointing(layer, mode=mode)
        # input/post-attention norms and the MLP, and the attention when asked
        assert compile_unit(layer, backend="aot_eager", attention=attention) == 3 + attention
        assert (layer.self_attn._compiled_call_impl is not None) == attention
        assert layer.mlp._compiled_call_impl is not None
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]


@pytest.mark.quick
def test_compile_rule_reaches_the_units():
    """``shard = { compile = true }`` compiles the decoder layers' children, their attention too when
    one kernel on the local sequence runs it (here transformers' SDPA: no sequence parallelism)."""
    import structlog
    import torch.distributed as dist

    from weft.core.context import RunContext
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.train.prepare import prepare_model

    recipe = Recipe.from_dict({
        "model": {"preset": "qwen2_text_tiny"},
        "rules": [{"when": {"path": "*.layers.0"}, "shard": {"strategy": "fsdp2", "compile": True}},
                  {"shard": {"strategy": "fsdp2"}}],
    })
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = RunContext(recipe=recipe, device=torch.device("cpu"), log=structlog.get_logger())
        model = prepare_model(recipe=recipe, pm=build_plugin_manager(entry_points=False), ctx=ctx).model
        first, second = model.model.layers
        assert first.mlp._compiled_call_impl is not None and first.input_layernorm._compiled_call_impl is not None
        assert first.self_attn._compiled_call_impl is not None
        assert second.mlp._compiled_call_impl is None  # the rule's path selects layer 0 only
    finally:
        dist.destroy_process_group()


@pytest.mark.quick
def test_attention_compiles_only_without_collectives():
    """Ring, Ulysses and USP run collectives inside the attention (dynamo would break around them)
    and the vision tower's varlen call is no torch operator: those attention modules stay eager."""
    import types

    from weft.core.recipe.rules import Decision
    from weft.plugins.attention import KernelParams, RingParams, traceable

    def plan(ulysses=1, ring=1):
        return types.SimpleNamespace(mesh=types.SimpleNamespace(ulysses=ulysses, ring=ring), packed=lambda: False,
                                     modality_of=lambda path: "vision" if ".visual." in path else "text")

    text = "model.language_model.layers.0.self_attn"
    auto = Decision(point="attention", strategy="auto", params=RingParams(), source="t:1", rule="t")
    local = Decision(point="attention", strategy="local", params=KernelParams(), source="t:1", rule="t")
    assert traceable(auto, text, plan()) and traceable(local, text, plan())
    assert not traceable(auto, text, plan(ring=2)) and not traceable(auto, text, plan(ulysses=2))
    assert not traceable(auto, "model.visual.blocks.0.attn", plan())
