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


@pytest.mark.parametrize(("mode", "attention", "whole"), [
    ("off", False, False), ("full", False, False), ("mlp", False, False), ("except_attention", False, False),
    ("off", True, False), ("except_attention", True, False), ("off", True, True)])
def test_compiled_children_keep_gradients(mode, attention, whole):
    """Gradients unchanged, the attention compiled or not; under except_attention the attention
    kernel's kept outputs are found again when the compiled attention is recomputed; ``whole``:
    the layer as one graph (the residual adds between its children traced with them)."""
    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        apply_checkpointing(layer, mode=mode)
        # input/post-attention norms and the MLP, and the attention when asked; or the layer
        assert compile_unit(layer, backend="aot_eager", attention=attention, whole=whole) == (
            1 if whole else 3 + attention)
        assert (layer.self_attn._compiled_call_impl is not None) == (attention and not whole)
        assert (layer.mlp._compiled_call_impl is not None) != whole
        assert (layer._compiled_call_impl is not None) == whole
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]


@pytest.mark.quick
def test_compile_scope_unit_by_rule_and_where_it_cannot_be():
    """``compile_scope = "unit"`` compiles a kept-whole, unrecomputed unit as one graph; with
    recomputation (hooks around the forward) or FSDP2 it is the rule's error, exit 2."""
    from weft.core.errors import WeftError
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(entry_points=False)
    for shard in ({"strategy": "none", "compile": True, "checkpoint": "full", "compile_scope": "unit"},
                  {"strategy": "fsdp2", "compile": True, "compile_scope": "unit"},
                  {"strategy": "none", "compile_scope": "unit"}):
        recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"},
                                   "rules": [{"when": {"path": "*.layers.*"}, "shard": shard}]})
        with pytest.raises(WeftError, match="compile_scope = 'unit' compiles a unit whose forward has no hooks"):
            plan_recipe(recipe, pm=pm, world_size=1)


def _prepared_layers(first_rule: dict, *, inference: bool = False) -> tuple:
    """The tiny text model prepared by rules: ``first_rule``'s shard for layer 0, the rule's
    strategy without compile for the rest; its two decoder layers (as weft eval and generate
    prepare them with ``inference``)."""
    import structlog
    import torch.distributed as dist

    from weft.core.context import RunContext
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.train.prepare import prepare_model

    recipe = Recipe.from_dict({
        "model": {"preset": "qwen2_text_tiny"},
        "rules": [{"when": {"path": "*.layers.0"}, "shard": first_rule},
                  {"shard": {"strategy": first_rule["strategy"]}}],
    })
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = RunContext(recipe=recipe, device=torch.device("cpu"), log=structlog.get_logger(), inference=inference)
        return tuple(prepare_model(recipe=recipe, pm=build_plugin_manager(entry_points=False), ctx=ctx).model
                     .model.layers)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("inference", [False, True], ids=["train", "eval-generate"])
def test_eval_and_generate_attach_no_recomputation(inference):
    """A rule's recomputation and activation offload serve a backward only: weft eval and
    generate (``ctx.inference``) attach neither, and compile what the rule compiles. Their
    hooks broke the compiled decoding step in every layer under torch 2.11 (the composable
    checkpoint's state lookup, ``module.__dict__.setdefault``: 2026-12-01's lease); training
    keeps them. Training runs the recomputed SwiGLU MLP by hand (its element-wise kernels compiled
    on their own, strategies/memory/swiglu.py), not through the module's compiled forward."""
    first, second = _prepared_layers({"strategy": "none", "checkpoint": "full", "offload_activations": True,
                                      "compile": True}, inference=inference)
    assert bool(first._forward_pre_hooks) is not inference and not second._forward_pre_hooks
    assert (first.mlp._compiled_call_impl is not None) is inference
    assert bool(first.mlp._forward_hooks) is not inference


@pytest.mark.quick
def test_compile_rule_reaches_the_units():
    """``shard = { compile = true }`` compiles the decoder layers' children, their attention too when
    one kernel on the local sequence runs it (here transformers' SDPA: no sequence parallelism);
    ``compile_scope = "unit"`` the layer itself, as one graph."""
    first, second = _prepared_layers({"strategy": "fsdp2", "compile": True})
    assert first.mlp._compiled_call_impl is not None and first.input_layernorm._compiled_call_impl is not None
    assert first.self_attn._compiled_call_impl is not None
    assert second.mlp._compiled_call_impl is None  # the rule's path selects layer 0 only
    first, second = _prepared_layers({"strategy": "none", "compile": True, "compile_scope": "unit"})
    assert first._compiled_call_impl is not None and first.mlp._compiled_call_impl is None
    assert second._compiled_call_impl is None


@pytest.mark.quick
def test_attention_compiles_only_without_collectives():
    """Ring, Ulysses and USP run collectives inside the attention (dynamo would break around them)
    and the vision tower's varlen call is no torch operator: those attention modules stay eager."""
    from weft.core.mesh_spec import MeshSpec
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import ModuleInfo, build_plan
    from weft.plugins.attention import traceable

    root = ModuleInfo(path="", class_name="Toy", kind="root")
    vision = ModuleInfo(path="model.visual.blocks.0.attn", class_name="VisionAttention", kind="attention",
                        modality="vision", heads=2, kv_heads=2, head_dim=16)
    text = ModuleInfo(path="model.language_model.layers.0.self_attn", class_name="Attention", kind="attention",
                      modality="text", heads=4, kv_heads=2, head_dim=16)
    registry = build_plugin_manager(entry_points=False).registry

    def traced(rules=(), *, ulysses=1, ring=1):
        """[vision, text]: whether each attention module compiles, as the Plan resolved it."""
        recipe = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": list(rules)})
        plan = build_plan(recipe=recipe, modules=[root, vision, text], registry=registry,
                          mesh=MeshSpec(ulysses=ulysses, ring=ring), world_size=ulysses * ring)
        return [traceable(m.get("attention"), m.info.path, plan) for m in plan.modules_for("attention")]

    # 'auto' without SP: sdpa (local where flash-attn-4 is installed) on text; the tower never.
    assert traced() == [False, True]
    assert traced([{"when": {"modality": "text"}, "attention": "local"}]) == [False, True]
    assert traced(ring=2) == [False, False] and traced(ulysses=2) == [False, False]


@pytest.mark.quick
def test_a_unit_scope_over_an_untraceable_attention_compiles_the_children_and_says_so():
    """``compile_scope = "unit"`` on a layer whose attention runs collectives (Ulysses): the
    layer is compiled child by child, its attention left eager, and the shard hook's return
    names the layer (logged as ``shard.compile_scope_children``)."""
    from weft.core.mesh_spec import MeshSpec
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe.rule_engine import ModuleInfo, build_plan
    from weft.plugins.shard.levers import compile_units

    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    infos = [ModuleInfo(path="", class_name="Toy", kind="root"),
             ModuleInfo(path="layers.0", class_name="Layer", kind="unit", modality="text"),
             ModuleInfo(path="layers.0.self_attn", class_name="Attention", kind="attention", modality="text",
                        heads=4, kv_heads=2, head_dim=16)]
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [
        {"when": {"path": "layers.0"}, "shard": {"strategy": "none", "compile": True, "compile_scope": "unit"}}]})
    plan = build_plan(recipe=recipe, modules=infos, registry=build_plugin_manager(entry_points=False).registry,
                      mesh=MeshSpec(ulysses=2), world_size=2)
    compiled, children = compile_units(model, plan.modules_for("shard"), plan=plan)
    assert children == ["layers.0"] and compiled == 1  # the MLP: the attention is not traced
    assert layer._compiled_call_impl is None and layer.mlp._compiled_call_impl is not None
    assert layer.self_attn._compiled_call_impl is None
