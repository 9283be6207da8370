"""The hook contract: one `test_hook_<name>` per hookspec, calling it through a plugin manager.

Each test registers a small in-process plugin (and/or relies on the built-in one)
and checks the semantics docs/hooks.md states: firstresult hooks return the first
non-None answer and `call_first` raises HookError when nobody answers; collect-all
hooks gather every implementation's list. A meta-test fails when a hookspec has no
test here or no section in docs/hooks.md.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import math
import pathlib
import re

import attrs
import pytest
import structlog
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from model_helpers import ListLog
from weft.core import hookspecs
from weft.core.context import RunContext, StepState
from weft.core.errors import HookError, PlanError, RecipeError
from weft.core.hookspecs import hookimpl
from weft.core.mesh_spec import MeshSpec
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import Decision, ModuleInfo, build_plan
from weft.core.registry import AttentionBinding, NoParams, Strategy, Verdict

ROOT = pathlib.Path(__file__).resolve().parents[1]

ROOT_MODULE = ModuleInfo(path="", class_name="Toy", kind="root")
TEXT_ATTN = ModuleInfo(path="layers.0.self_attn", class_name="Qwen2Attention", kind="attention", modality="text",
                       heads=4, kv_heads=2, head_dim=16)


def make_pm(*plugins: tuple[str, object]):
    # entry_points=False: an installed third-party plugin must not change these tests.
    return build_plugin_manager(extra=plugins, entry_points=False)


def make_plan(pm, rules: list[dict], modules: list[ModuleInfo] = (ROOT_MODULE,)):
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "rules": rules})
    plan = build_plan(recipe=recipe, modules=list(modules), registry=pm.registry, mesh=MeshSpec(), world_size=1)
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"), log=ListLog())
    return recipe, plan, ctx


def decision(point: str, strategy: str) -> Decision:
    return Decision(point=point, strategy=strategy, params=NoParams(), source="test", rule="test")


@contextlib.contextmanager
def one_rank_group():
    """A one-rank gloo process group, as `weft run` makes for a single process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EchoParams:
    word: str = attrs.field(default="hi", metadata={"doc": "what to say"})


class EchoPlugin:
    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="attention", name="echo", params=EchoParams, summary="says a word")]


@pytest.mark.quick
def test_hook_weft_strategies():
    pm = make_pm(("echo-plugin", EchoPlugin()))
    # Collect-all: one list per implementing plugin, built-ins included.
    lists = pm.hook.weft_strategies()
    assert len(lists) == len(pm.hook.weft_strategies.get_hookimpls()) == 12
    assert all(isinstance(s, Strategy) for items in lists for s in items)
    # The registry records which plugin declared each strategy.
    echo = pm.registry.get("attention", "echo")
    assert echo is not None and echo.plugin == "echo-plugin" and echo.params is EchoParams
    assert pm.registry.get("guard", "finite").plugin == "weft.plugins.guard"
    assert "echo" in pm.registry.names("attention") and "sdpa" in pm.registry.names("attention")
    # The params class validates rule tables: a bad key fails with the strategy's fields listed.
    _, plan, _ = make_plan(pm, [{"attention": {"strategy": "echo", "word": "yo"}}], [ROOT_MODULE, TEXT_ATTN])
    assert plan.modules[1].get("attention").params == EchoParams(word="yo")
    with pytest.raises(Exception, match="unknown key 'wrod'.*word"):
        make_plan(pm, [{"attention": {"strategy": "echo", "wrod": "yo"}}], [ROOT_MODULE, TEXT_ATTN])

    # Two plugins declaring one (point, name): an error naming both.
    class Clash:
        @hookimpl
        def weft_strategies(self):
            return [Strategy(point="attention", name="sdpa")]

    with pytest.raises(PlanError, match=r"'sdpa'.*'weft\.plugins\.attention'.*'clash'"):
        make_pm(("clash", Clash())).registry

    # Replacing a built-in: block it and declare the same strategy name elsewhere.
    class MyFinite:  # a replacement declares every guard the default rules name
        @hookimpl
        def weft_strategies(self):
            return [Strategy(point="guard", name="finite", params=EchoParams),
                    Strategy(point="guard", name="update", params=NoParams)]

    replaced = build_plugin_manager(block=["weft.plugins.guard"], extra=[("my-finite", MyFinite())], entry_points=False)
    assert replaced.registry.get("guard", "finite").plugin == "my-finite"
    _, plan, _ = make_plan(replaced, [])
    assert plan.decision("guard").params == EchoParams()
    # Blocked without a replacement: the defaults name a strategy nobody declares.
    with pytest.raises(RecipeError, match="unknown guard strategy 'finite'"):
        make_plan(build_plugin_manager(block=["weft.plugins.guard"], entry_points=False), [])


class ToyFamily:
    """A third-party model family: the built-in base with its own model_type."""

    def __init__(self) -> None:
        from weft.plugins.models.base import TransformersFamily

        self.family = TransformersFamily(name="toy_lm", model_types=("toy_lm",), summary="a toy family")

    @hookimpl
    def weft_models(self):
        return [self.family]


@pytest.mark.quick
def test_hook_weft_models(tmp_path):
    from weft.core.models import ModelFamily

    toy = ToyFamily()
    pm = make_pm(("toy", toy))
    # Collect-all: one list per implementing plugin (the built-in families and the toy).
    lists = pm.hook.weft_models()
    assert len(lists) == len(pm.hook.weft_models.get_hookimpls()) == 2
    assert all(isinstance(a, ModelFamily) for items in lists for a in items)
    assert pm.models.get("toy_lm") is toy.family
    assert pm.models.get("qwen2_5_vl").name == "qwen2_5_vl" and pm.models.get("qwen2").name == "causal_lm"
    assert ("toy", toy.family) in pm.models.all()
    # The core picks the family from the model directory's config.json.
    (tmp_path / "config.json").write_text('{"model_type": "toy_lm"}')
    recipe = Recipe.from_dict({"model": {"path": str(tmp_path)}})
    assert pm.models.for_recipe(recipe) is toy.family
    # Without the plugin: a user error naming the model_type and the families installed.
    with pytest.raises(RecipeError, match=r"no installed model family handles model_type 'toy_lm'; "
                                          r"families installed: causal_lm \(qwen2, .*qwen2_5_vl \(qwen2_5_vl\)"):
        make_pm().models.for_recipe(recipe)
    # Two plugins claiming one model_type: an error naming both.
    with pytest.raises(RecipeError,
                       match=r"model_type 'toy_lm' is handled twice: by plugin 'toy' and by plugin 'again'"):
        make_pm(("toy", toy), ("again", ToyFamily())).models


@pytest.mark.quick
def test_a_family_that_cannot_share_its_tower_refuses_vision_ulysses():
    """A family with shares_vision = False (a tower whose blocks do more than pass the patch
    sequence along): the planner refuses a vision rule that shares one image over the SP
    ranks, naming the module, the rule and the family, before any process starts."""
    from weft.core.plan.planner import plan_recipe
    from weft.plugins.models.families import QWEN2_5_VL

    class Family:
        @hookimpl
        def weft_models(self):
            return [attrs.evolve(QWEN2_5_VL, name="no_sharing", shares_vision=False)]

    pm = build_plugin_manager(block=["weft.plugins.models"], extra=[("family", Family())], entry_points=False)
    recipe = Recipe.from_toml("tiny-vl-sp")  # vision_ulysses with min_patches = 24
    with pytest.raises(PlanError, match=r"model\.visual\.blocks\.0\.attn: attention strategy 'vision_ulysses' "
                                        r"\(rule at .*tiny-vl-sp\.toml:\d+\).*family 'no_sharing' does not support"):
        plan_recipe(recipe, pm=pm, world_size=4)
    plan, _ = plan_recipe(Recipe.from_toml("tiny-vl"), pm=pm, world_size=4)  # images only spread: fine
    assert plan.vision_share_threshold() is None


# ---------------------------------------------------------------------------
# model preparation
# ---------------------------------------------------------------------------


class FreezePlugin:
    """A shard strategy that freezes the modules the Plan gives it, in place."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="shard", name="freeze", summary="requires_grad = False")]

    @hookimpl
    def weft_shard(self, model, plan):  # an implementation may take fewer arguments than the spec
        self.calls += 1
        for unit in plan.modules_for("shard", "freeze"):
            model.get_submodule(unit.info.path).requires_grad_(False)


@pytest.mark.quick
def test_hook_weft_shard():
    freeze = FreezePlugin()
    pm = make_pm(("freeze", freeze))
    modules = [ROOT_MODULE, ModuleInfo(path="0", class_name="Linear", kind="unit", modality="text"),
               ModuleInfo(path="1", class_name="Linear", kind="unit", modality="text")]
    rules = [{"when": {"path": "0"}, "shard": {"strategy": "freeze"}},
             {"when": {"path": ["", "1"]}, "shard": {"strategy": "none"}}]
    _, plan, ctx = make_plan(pm, rules, modules)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    # Collect-all: every implementation runs; both return None, so the result is empty.
    assert pm.hook.weft_shard(model=model, plan=plan, mesh=None, ctx=ctx) == []
    assert freeze.calls == 1
    assert not any(p.requires_grad for p in model[0].parameters())
    assert all(p.requires_grad for p in model[1].parameters())

    # The built-in fsdp2 strategy (the default rule) on a one-rank gloo mesh.
    from torch.distributed.tensor import DTensor

    from weft.core.mesh import build_device_mesh

    pm = make_pm()
    _, plan, ctx = make_plan(pm, [], modules)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with one_rank_group():
        mesh = build_device_mesh(plan.mesh, device_type="cpu")
        assert pm.hook.weft_shard(model=model, plan=plan, mesh=mesh, ctx=ctx) == []
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert ("shard.fsdp2", {"units": 2, "mesh": [1, 1, 1, 1]}) in ctx.log.events


class ToyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.v = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.v(self.q(x))


TOY_UNITS = [ROOT_MODULE, ModuleInfo(path="layers.0", class_name="ToyBlock", kind="unit", modality="text"),
             ModuleInfo(path="layers.1", class_name="ToyBlock", kind="unit", modality="text")]


@pytest.mark.quick
def test_hook_weft_adapter():
    from weft.core.registry import Adapters

    pm = make_pm()
    rules = [{"name": "lora q of layer 0", "when": {"path": "layers.0"},
              "adapter": {"strategy": "lora", "r": 2, "alpha": 4, "targets": ["q"]}},
             {"name": "lora v of layer 1", "when": {"path": "layers.1"},
              "adapter": {"strategy": "lora", "r": 3, "alpha": 3, "targets": ["v"]}}]
    _, plan, ctx = make_plan(pm, rules, TOY_UNITS)
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.layers = torch.nn.ModuleList([ToyBlock(), ToyBlock()])
    x = torch.randn(3, 4)
    before = model.layers[1](model.layers[0](x))
    # Collect-all: the built-in lora answers with what it added; `none` (the defaults') adds nothing.
    [added] = pm.hook.weft_adapter(model=model, plan=plan, ctx=ctx)
    assert isinstance(added, Adapters)
    assert added.names == ("layers.0.q.lora_A.default.weight", "layers.0.q.lora_B.default.weight",
                           "layers.1.v.lora_A.default.weight", "layers.1.v.lora_B.default.weight")
    # One PEFT adapter, each layer with its rule's rank and scale (alpha / r).
    assert model.layers[1].v.lora_A.default.weight.shape == (3, 4) and model.layers[1].v.scaling["default"] == 1.0
    assert model.layers[0].q.scaling["default"] == 2.0
    assert [n for n, p in model.named_parameters() if p.requires_grad] == list(added.names)  # the base frozen
    added.init(model, seed=0)
    assert torch.equal(model.layers[0].q.lora_B.default.weight, torch.zeros(4, 2))  # B = 0: the base's output
    assert model.layers[1].v.lora_A.default.weight.std() > 0.1  # A ~ N(0, 1/r)
    assert torch.allclose(model.layers[1](model.layers[0](x)), before)
    assert ("adapter.lora", {"layers": 2, "parameters": 16 + 24, "ranks": [2, 3]}) in ctx.log.events
    assert pm.hook.weft_adapter(model=model, plan=make_plan(pm, [], TOY_UNITS)[1], ctx=ctx) == []

    # A rule that decides no module, and one whose targets name no layer: plan errors naming the rule.
    with pytest.raises(PlanError, match="adapter rule 'nowhere' decides no module"):
        make_plan(pm, [{"name": "nowhere", "when": {"path": "layers.9"}, "adapter": {"strategy": "lora"}}], TOY_UNITS)
    _, plan, ctx = make_plan(pm, [{"name": "no k", "adapter": {"strategy": "lora", "targets": ["k_proj"]}}],
                             TOY_UNITS)
    with pytest.raises(PlanError, match=r"rule 'no k': targets \['k_proj'\] name no linear layer.*\['q', 'v'\]"):
        pm.hook.weft_adapter(model=torch.nn.Sequential(ToyBlock()), plan=plan, ctx=ctx)


class EchoAttention(EchoPlugin):
    def __init__(self) -> None:
        self.asked: list[str] = []

    @hookimpl
    def weft_attention(self, decision, module_path):
        self.asked.append(decision.strategy)
        if decision.strategy != "echo":
            return None  # not ours: let another plugin answer
        return AttentionBinding(name=f"echo_{decision.params.word}", fn=lambda *a, **k: None)


@pytest.mark.quick
def test_hook_weft_attention():
    echo = EchoAttention()
    pm = make_pm(("echo-plugin", echo))
    rules = [{"when": {"modality": "text", "seq_len": {"gt": 10**9}}, "attention": {"strategy": "echo"}}]
    _, plan, ctx = make_plan(
        pm, rules + [{"when": {"class": "*Attention"}, "attention": {"strategy": "echo", "word": "yo"}}],
        [ROOT_MODULE, TEXT_ATTN],
    )
    mine = plan.modules_for("attention")[0].get("attention")
    assert mine.strategy == "echo" and mine.params.word == "yo"  # the seq_len rule did not match
    binding = pm.call_first("weft_attention", decision=mine, module_path=TEXT_ATTN.path, plan=plan, mesh=None, ctx=ctx)
    assert binding.name == "echo_yo" and callable(binding.fn)

    # Firstresult: the echo plugin (registered last, so asked first) declines "sdpa";
    # the built-in answers with a name transformers already knows.
    _, plan, ctx = make_plan(pm, [{"attention": "sdpa"}], [ROOT_MODULE, TEXT_ATTN])
    sdpa = plan.modules_for("attention")[0].get("attention")
    assert pm.call_first("weft_attention", decision=sdpa, module_path=TEXT_ATTN.path, plan=plan, mesh=None,
                         ctx=ctx) == AttentionBinding(name="sdpa")
    assert echo.asked[-1] == "sdpa"
    # The default rule, on a mesh without sequence parallelism, also comes down to sdpa.
    _, plan, ctx = make_plan(pm, [], [ROOT_MODULE, TEXT_ATTN])
    default = plan.modules_for("attention")[0].get("attention")
    assert pm.call_first("weft_attention", decision=default, module_path=TEXT_ATTN.path, plan=plan, mesh=None,
                         ctx=ctx) == AttentionBinding(name="sdpa")

    # Nobody owns the strategy: the plain hook returns None, call_first names hook and plugins.
    nobody = decision("attention", "nobody")
    assert pm.hook.weft_attention(decision=nobody, module_path="x", plan=plan, mesh=None, ctx=ctx) is None
    with pytest.raises(HookError, match=r"weft_attention.*'nobody'.*weft\.plugins\.attention.*echo-plugin"):
        pm.call_first("weft_attention", decision=nobody, module_path="x", plan=plan, mesh=None, ctx=ctx)


@pytest.mark.quick
def test_a_vision_tower_is_known_by_its_modality_not_its_name():
    """A family whose tower is not called ``visual``: its attention resolves as the planner
    declared it (vision), not as text. With packed documents text ``auto`` needs document-aware
    attention (ring on one rank), a vision tower keeps its own (sdpa here, no flash-attn-4)."""
    from weft.plugins.attention import traceable
    from weft.strategies.attention.kernels.blocks import fa4_importable

    tower = ModuleInfo(path="encoder.blocks.0.attn", class_name="TowerAttention", kind="attention",
                       modality="vision", heads=2, kv_heads=2, head_dim=16)
    pm = make_pm()
    _, plan, ctx = make_plan(pm, [{"batching": {"strategy": "token_budget", "pack": True}}],
                             [ROOT_MODULE, tower, TEXT_ATTN])
    assert plan.packed() and plan.modality_of(tower.path) == "vision" and not fa4_importable()
    vision = plan.modules_for("attention")[0].get("attention")
    assert (vision.strategy, vision.resolved_from) == ("sdpa", "auto")  # resolved once, in the Plan
    binding = pm.call_first("weft_attention", decision=vision, module_path=tower.path, plan=plan, mesh=None, ctx=ctx)
    assert binding == AttentionBinding(name="sdpa")
    assert not traceable(vision, tower.path, plan)
    text = plan.modules_for("attention")[1].get("attention")
    assert traceable(text, TEXT_ATTN.path, plan) is False  # packed: ring on one rank, not a single kernel


@pytest.mark.quick
def test_hook_weft_metrics(tmp_path):
    pm = make_pm()
    recipe, plan, ctx = make_plan(pm, [])  # the default rules: the jsonl sink
    assert [d.strategy for d in plan.decisions_of("metrics")] == ["jsonl"]
    ctx = attrs.evolve(ctx, run_dir=tmp_path)
    # Collect-all, nothing returned; the jsonl sink appends each step's row, ignores the end.
    assert pm.hook.weft_metrics(event="step", row={"step": 1, "loss": 2.5}, plan=plan, ctx=ctx) == []
    pm.hook.weft_metrics(event="step", row={"step": 2, "loss": 2.0}, plan=plan, ctx=ctx)
    pm.hook.weft_metrics(event="end", row={"status": "completed"}, plan=plan, ctx=ctx)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]


@pytest.mark.quick
def test_hook_weft_rope():
    pm = make_pm()
    rule = {"name": "long", "when": {"modality": "text", "seq_len": {"gt": 1024}},
            "rope": {"strategy": "yarn", "factor": 4.0}}
    recipe, plan, _ = make_plan(pm, [rule], [ROOT_MODULE, TEXT_ATTN])  # seq_len 2048: the rule matches
    chosen = plan.modules_for("rope")[0].get("rope")
    assert (chosen.strategy, chosen.rule) == ("yarn", "long")
    assert pm.call_first("weft_rope", decision=chosen, recipe=recipe, plan=plan) == {
        "rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max": 0}
    short, plan_short, _ = make_plan(pm, [dict(rule, when={"modality": "text", "seq_len": {"gt": 4096}})],
                                     [ROOT_MODULE, TEXT_ATTN])
    default = plan_short.modules_for("rope")[0].get("rope")
    assert default.strategy == "auto" and pm.call_first("weft_rope", decision=default, recipe=short,
                                                        plan=plan_short) == {}  # the [model] keys stand
    with pytest.raises(HookError, match=r"weft_rope.*'longrope'"):
        pm.call_first("weft_rope", decision=decision("rope", "longrope"), recipe=recipe, plan=plan)


@pytest.mark.quick
def test_hook_weft_kv_cache():
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    pm = make_pm()
    _, plan, ctx = make_plan(pm, [], [ROOT_MODULE, TEXT_ATTN])
    chosen = plan.modules_for("kv_cache")[0].get("kv_cache")
    # The default rule's auto, resolved when the Plan is built: static without sequence parallelism.
    assert chosen.resolved_from == "auto" and chosen.strategy == "static"
    from weft.plugins.kv_cache.static import StaticCache

    cache = pm.call_first("weft_kv_cache", decision=chosen, model=model, plan=plan, mesh=None, ctx=ctx)
    assert isinstance(cache, StaticCache) and cache.compile_step  # its defaults: StaticParams()
    assert len(cache.layers) == config.num_hidden_layers
    kv = torch.zeros(1, config.num_key_value_heads, 3,
                     config.hidden_size // config.num_attention_heads)  # (B, H_kv, S, D)
    cache.reserve(5)
    cache.begin_prefill(keep=None, prompt=3)
    cache.update(kv, kv, layer_idx=0)
    assert cache.layers[0].keys.shape[2] == 5  # the prompt and the tokens to come, preallocated
    # transformers' DynamicCache by rule.
    dynamic = Decision(point="kv_cache", strategy="dynamic", params=NoParams(), source="test", rule="test")
    cache = pm.call_first("weft_kv_cache", decision=dynamic, model=model, plan=plan, mesh=None, ctx=ctx)
    assert isinstance(cache, DynamicCache)
    cache.update(kv, kv, layer_idx=0)
    assert cache.get_seq_length() == 3
    # Building a cache changes nothing on the model.
    assert model.config.use_cache == config.use_cache
    # The paged cache: a vision pool and text pages (2 rows each) that grow in place.
    from weft.plugins.kv_cache import PagedParams

    paged = Decision(point="kv_cache", strategy="paged", params=PagedParams(page_tokens=2), source="test",
                     rule="test")
    cache = pm.call_first("weft_kv_cache", decision=paged, model=model, plan=plan, mesh=None, ctx=ctx)
    cache.begin_prefill(keep=None, prompt=3, vision=torch.tensor([False, True, False]))
    cache.update(kv, kv, layer_idx=0)
    row = 2 * kv[:, :, :1].numel() * kv.element_size()  # one token's keys and values
    assert cache.layers[0].partition_bytes() == {"vision": row, "text": 2 * row, "text_capacity": 2 * row}
    cache.begin_decode()
    cache.update(kv[:, :, :1], kv[:, :, :1], layer_idx=0)
    assert cache.layers[0].partition_bytes()["text_capacity"] == 4 * row and cache.get_seq_length() == 4
    with pytest.raises(HookError, match=r"weft_kv_cache.*'quantized'"):
        pm.call_first("weft_kv_cache", decision=decision("kv_cache", "quantized"), model=model, plan=plan,
                      mesh=None, ctx=ctx)


@attrs.frozen(kw_only=True)
class FixedParams:
    steps: int = 2
    tokens: int = 4


class FixedBatches:
    """A batching strategy yielding the same tiny step over and over."""

    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="batching", name="fixed", params=FixedParams)]

    @hookimpl
    def weft_batching(self, decision, recipe, plan, mesh, model, ctx):
        if decision.strategy != "fixed":
            return None
        ids = torch.arange(decision.params.tokens).unsqueeze(0)  # (B=1, S)
        return [[{"input_ids": ids, "labels": ids.clone()}] for _ in range(decision.params.steps)]


@pytest.mark.quick
def test_hook_weft_batching():
    import weft.plugins.batching as builtin

    pm = make_pm(("fixed", FixedBatches()))
    recipe, plan, ctx = make_plan(pm, [{"batching": {"strategy": "fixed", "steps": 3}}])
    chosen = plan.decision("batching")
    assert (chosen.strategy, chosen.params) == ("fixed", FixedParams(steps=3))
    # The built-in declines a strategy it does not own.
    assert builtin.weft_batching(decision=chosen, recipe=recipe, plan=plan, mesh=None, model=None, ctx=ctx) is None
    steps = list(pm.call_first("weft_batching", decision=chosen, recipe=recipe, plan=plan, mesh=None, model=None,
                               ctx=ctx))
    assert len(steps) == 3 and all(len(step) == 1 for step in steps)
    assert steps[0][0]["input_ids"].shape == (1, 4)
    # And the fake declines the default.
    _, default_plan, _ = make_plan(pm, [])
    assert default_plan.decision("batching").strategy == "token_budget"
    assert FixedBatches().weft_batching(decision=default_plan.decision("batching"), recipe=recipe, plan=plan, mesh=None,
                                        model=None, ctx=ctx) is None
    with pytest.raises(HookError, match=r"no plugin answered hook weft_batching for strategy 'nobody'; "
                                        r"registered plugins: .*weft\.plugins\.batching.*fixed"):
        pm.call_first("weft_batching", decision=decision("batching", "nobody"), recipe=recipe, plan=plan, mesh=None,
                      model=None, ctx=ctx)


class NoteGradSync:
    """A second grad_sync implementation: answers only when its strategy is chosen."""

    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="grad_sync", name="note")]

    @hookimpl
    def weft_grad_sync(self, model, plan):
        if not any(d.strategy == "note" for d in plan.decisions_of("grad_sync")):
            return None
        return [("grads_seen", sum(1 for p in model.parameters() if p.grad is not None))]


@pytest.mark.quick
def test_hook_weft_grad_sync():
    pm = make_pm(("note", NoteGradSync()))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    (model(torch.randn(5, 8)).pow(2).sum() * 10).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert expected > 0.5
    # A list of strategies: both implementations act; results are gathered (collect-all).
    _, plan, ctx = make_plan(pm, [{"grad_sync": [{"strategy": "clip", "max_norm": 0.5}, {"strategy": "note"}]}])
    with one_rank_group():
        results = pm.hook.weft_grad_sync(model=model, plan=plan, mesh=None, ctx=ctx)
    assert sorted(name for result in results for name, _ in result) == ["grad_norm", "grads_seen"]
    merged = dict(item for result in results for item in result)  # as the loop reads them
    assert merged["grads_seen"] == 2
    torch.testing.assert_close(merged["grad_norm"], expected)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(0.5), rtol=1e-5, atol=1e-5)
    for grad, before in zip((p.grad for p in model.parameters()), grads):
        torch.testing.assert_close(grad, before * (0.5 / expected), rtol=1e-5, atol=1e-6)

    # max_norm = 0 measures only; without a clip decision the built-in stays out.
    _, plan, ctx = make_plan(pm, [{"grad_sync": {"strategy": "clip", "max_norm": 0.0}}])
    with one_rank_group():
        (result,) = pm.hook.weft_grad_sync(model=model, plan=plan, mesh=None, ctx=ctx)
    torch.testing.assert_close(result[0][1], torch.tensor(0.5), rtol=1e-5, atol=1e-5)
    _, plan, ctx = make_plan(pm, [{"grad_sync": {"strategy": "note"}}])
    assert pm.hook.weft_grad_sync(model=model, plan=plan, mesh=None, ctx=ctx) == [[("grads_seen", 2)]]


class CheckpointGuard:
    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="guard", name="every_step_checkpoint")]

    @hookimpl
    def weft_guard(self, event, plan):
        if event != "step_end" or not any(d.strategy == "every_step_checkpoint" for d in plan.decisions_of("guard")):
            return None
        return Verdict(action="checkpoint", guard="every_step_checkpoint")


@attrs.frozen(kw_only=True)
class SgdParams:
    lr: float | None = None
    lr_scale: float = 1.0
    weight_decay: float | None = None
    momentum: float = 0.9


class SgdPlugin:
    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="optimizer", name="test_sgd", params=SgdParams, summary="SGD"),
                Strategy(point="optimizer", name="test_mute", params=SgdParams, summary="answers nothing")]

    @hookimpl
    def weft_optimizer(self, decision, groups, recipe, ctx):
        if decision.strategy != "test_sgd":
            return None
        return torch.optim.SGD([{"params": list(g.params), "lr": g.lr, "weight_decay": g.weight_decay}
                                for g in groups], lr=recipe.train.lr, momentum=decision.params.momentum)


@pytest.mark.quick
def test_hook_weft_optimizer():
    """A third-party optimizer by rule: the core resolves each group's peak lr (rule lr or
    train.lr, times lr_scale) and weight decay, wraps it in the schedule; nobody answering is
    a HookError naming the strategy."""
    from weft.core.train.optimizer_setup import make_optimizer

    pm = make_pm(("sgd-plugin", SgdPlugin()))
    rule = {"optimizer": {"strategy": "test_sgd", "momentum": 0.5, "lr_scale": 2.0, "weight_decay": 0.1}}
    recipe, plan, ctx = make_plan(pm, [rule])
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = make_optimizer(recipe, model, plan=plan, pm=pm, ctx=ctx)
    (group,) = optimizer.param_groups
    assert isinstance(optimizer, torch.optim.SGD) and group["momentum"] == 0.5
    assert group["initial_lr"] == 2 * recipe.train.lr and group["weight_decay"] == 0.1
    assert group["params"] == list(model.parameters()) and group["rule"].startswith("rule 1 (")
    assert ("optimizer.group", "test_sgd") in [(e, f.get("strategy")) for e, f in ctx.log.events]
    scheduler.step()
    assert group["lr"] == 2 * recipe.train.lr * scheduler.lr_lambdas[0](1)
    recipe, plan, ctx = make_plan(pm, [{"optimizer": {"strategy": "test_mute"}}])
    with pytest.raises(HookError, match="no plugin answered hook weft_optimizer for strategy 'test_mute'"):
        make_optimizer(recipe, model, plan=plan, pm=pm, ctx=ctx)


@pytest.mark.quick
def test_hook_weft_guard():
    pm = make_pm(("ckpt", CheckpointGuard()))
    _, plan, ctx = make_plan(pm, [{"guard": [{"strategy": "finite", "max_consecutive_skips": 3},
                                             {"strategy": "every_step_checkpoint"}]}])

    def verdicts(event: str, **state) -> list[Verdict]:
        # Collect-all: None answers are dropped by pluggy; the loop takes the strongest.
        return pm.hook.weft_guard(event=event, state=StepState(step=1, **state), plan=plan, ctx=ctx)

    assert verdicts("step_start", loss=math.nan) == []  # finite looks only at step_end
    fine = verdicts("step_end", loss=2.0, grad_norm=1.0)
    assert sorted(v.action for v in fine) == ["checkpoint", "continue"]
    assert Verdict.strongest(fine).action == "checkpoint"
    nan = verdicts("step_end", loss=math.nan, grad_norm=1.0)
    strongest = Verdict.strongest(nan)
    assert (strongest.action, strongest.guard) == ("skip", "finite") and "loss" in strongest.reason
    assert Verdict.strongest(verdicts("step_end", loss=1.0, grad_norm=math.inf)).action == "skip"
    # The third non-finite step in a row aborts (max_consecutive_skips = 3).
    assert Verdict.strongest(verdicts("step_end", loss=math.nan, consecutive_skips=1)).action == "skip"
    aborted = Verdict.strongest(verdicts("step_end", loss=math.nan, consecutive_skips=2))
    assert aborted.action == "abort" and "3 steps in a row" in aborted.reason
    assert Verdict.strongest([]).action == "continue"


# ---------------------------------------------------------------------------
# tracing (WEFT_TRACE_HOOKS)
# ---------------------------------------------------------------------------


@pytest.mark.quick
def test_trace_logs_every_hook_call():
    with capture_logs() as logs:
        pm = build_plugin_manager(trace=True, log=structlog.get_logger(), entry_points=False)
        _, plan, ctx = make_plan(pm, [], [ROOT_MODULE, TEXT_ATTN])
        pm.hook.weft_attention(decision=plan.modules[1].get("attention"), module_path=TEXT_ATTN.path, plan=plan,
                               mesh=None, ctx=ctx)
        pm.hook.weft_guard(event="step_start", state=StepState(step=1), plan=plan, ctx=ctx)
    calls = [entry for entry in logs if entry["event"] == "hook.call"]
    assert [c["hook"] for c in calls] == ["weft_attention", "weft_guard"]
    for call in calls:
        assert call["rank"] == 0 and call["log_level"] == "info"
        assert isinstance(call["duration_ms"], float) and call["duration_ms"] >= 0
    assert calls[0]["plugins"] == ["weft.plugins.attention"]

    # Without trace nothing is logged per call.
    log = ListLog()
    quiet = build_plugin_manager(log=log, entry_points=False)
    quiet.hook.weft_guard(event="step_start", state=StepState(step=1), plan=plan, ctx=ctx)
    assert not [e for e, _ in log.events if e == "hook.call"]


@pytest.mark.quick
def test_weft_trace_hooks_env(monkeypatch, capsys):
    from weft.core.plugin_manager import plugin_manager_from_env

    monkeypatch.setenv("WEFT_TRACE_HOOKS", "1")
    pm = plugin_manager_from_env()
    _, plan, ctx = make_plan(pm, [])
    pm.hook.weft_guard(event="step_start", state=StepState(step=1), plan=plan, ctx=ctx)
    err = capsys.readouterr().err
    assert "hook.call" in err and "weft_guard" in err and "duration_ms" in err


# ---------------------------------------------------------------------------
# meta: every hookspec is tested and documented
# ---------------------------------------------------------------------------


def hookspec_signatures() -> dict[str, str]:
    specs = {}
    for name, fn in vars(hookspecs).items():
        if name.startswith("weft_") and getattr(fn, f"{hookspecs.PROJECT}_spec", None) is not None:
            specs[name] = f"{name}({', '.join(inspect.signature(fn).parameters)})"
    return specs


@pytest.mark.quick
def test_every_hookspec_is_tested_and_documented():
    specs = hookspec_signatures()
    assert set(specs) == {f"weft_{p}" for p in ("strategies", "models", *hookspecs.HOOK_POINTS)}
    tests = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        tests |= {node.name for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_hook_")}
    untested = sorted(name for name in specs if f"test_hook_{name}" not in tests)
    docs = (ROOT / "docs" / "hooks.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^### `([^`]+)`\s*$", docs, flags=re.MULTILINE))
    undocumented = sorted(f"{name}: expected heading ### `{sig}`" for name, sig in specs.items() if sig not in headings)
    assert not untested and not undocumented, (f"hookspecs without a test_hook_<name> in tests/: {untested}; "
                                               f"without a heading in docs/hooks.md: {undocumented}")


def test_building_the_plugin_manager_imports_no_torch():
    """Plugins declare strategies without heavy imports: `weft plugins` and recipe validation stay fast."""
    import subprocess
    import sys

    code = ("import sys; from weft.core.plugin_manager import build_plugin_manager; "
            "build_plugin_manager(entry_points=False).registry; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.quick
def test_a_plugin_writing_to_the_context_fails(tmp_path):
    """The context is frozen for plugins: a hook that assigns to a field or to a property the
    core keeps (start_step, optimizer, positions) fails; the two dicts plugins keep their own
    state in stay writable, and a context made anew from it shares the core's run state."""

    class Writer:
        def __init__(self, field: str) -> None:
            self.field = field

        @hookimpl
        def weft_metrics(self, event, row, plan, ctx):
            ctx.count("rows")
            ctx.plugin_state["writer"] = row["step"]
            setattr(ctx, self.field, 7)

    frozen = attrs.exceptions.FrozenInstanceError
    for field, error in (("recipe", frozen), ("run_dir", frozen), ("start_step", AttributeError),
                         ("optimizer", AttributeError)):
        pm = make_pm(("writer", Writer(field)))
        _, plan, ctx = make_plan(pm, [{"metrics": {"strategy": "jsonl"}}])
        ctx = attrs.evolve(ctx, run_dir=tmp_path)
        with pytest.raises(error):
            pm.hook.weft_metrics(event="step", row={"step": 1}, plan=plan, ctx=ctx)
        assert ctx.start_step == 0 and ctx.optimizer is None
    assert (ctx.counters, ctx.plugin_state) == ({"rows": 1}, {"writer": 1})
    again = attrs.evolve(ctx, one_pass=True)
    ctx.state.start_step = 3  # the core's own, as a resume sets it
    assert again.start_step == 3 and again.counters is ctx.counters
