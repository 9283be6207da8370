"""The shard levers one at a time on a small model (plugins/shard/levers.py, plugins/shard/fsdp2_steps.py),
each by its rule and with its effect checked; and a third-party shard strategy
(tests/weft_light_shard.py) that reuses three of them, planned by a rule and trained a step."""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
import textwrap

import attrs
import pytest
import torch
import torch.distributed as dist

from model_helpers import ListLog
from weft.core.context import RunContext
from weft.core.errors import PlanError
from weft.core.mesh_spec import MeshSpec
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import ModuleInfo, build_plan
from weft.plugins.shard import fsdp2_steps as shard_fsdp2
from weft.plugins.shard import levers as shard_levers
from weft.plugins.shard.levers import Recompute, Storage, config_of

HIDDEN = 16  # float8's layers need dimensions that are multiples of 16


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.mlp = torch.nn.Linear(HIDDEN, HIDDEN), Mlp()

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


INFOS = [ModuleInfo(path="", class_name="Toy", kind="root"),
         ModuleInfo(path="layers.0", class_name="Block", kind="unit", modality="text"),
         ModuleInfo(path="layers.1", class_name="Block", kind="unit", modality="text")]


def planned(first: dict, *, root: dict | None = None, inference: bool = False, entry_points: bool = False):
    """(plan, ctx, units): ``first`` the shard rule of layers.0; layers.1 and the root 'none'
    (``root``: the root's own rule)."""
    rules = [{"when": {"path": "layers.0"}, "shard": first}]
    rules += [{"when": {"path": ""}, "shard": root}] if root else []
    rules += [{"shard": {"strategy": "none"}}]
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "rules": rules})
    plan = build_plan(recipe=recipe, modules=INFOS, registry=build_plugin_manager(entry_points=entry_points).registry,
                      mesh=MeshSpec(), world_size=1)
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"), log=ListLog(), inference=inference)
    return plan, ctx, plan.modules_for("shard")


def forward_backward(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.pow(2).mean().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def assert_same_run(model, reference, x):
    out, dx, grads = forward_backward(model, x)
    ref_out, ref_dx, ref_grads = forward_backward(reference, x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.quick
def test_a_lever_config_comes_from_fields_of_the_same_names_or_an_instance_held():
    @attrs.frozen(kw_only=True)
    class Flat:
        checkpoint: str = "full"

    @attrs.frozen(kw_only=True)
    class Composed:
        recompute: Recompute = Recompute(checkpoint="mlp")

    assert config_of(Flat(), Recompute) == Recompute(checkpoint="full")
    assert config_of(Composed(), Recompute) == Recompute(checkpoint="mlp")
    assert config_of(Flat(), Storage) is None  # no storage_dtype field: the lever leaves the unit alone


@pytest.mark.quick
def test_cast_storage_gives_each_unit_its_rules_dtype():
    plan, ctx, units = planned({"strategy": "none", "storage_dtype": "bfloat16"})
    model = Toy()
    shard_levers.cast_storage(model, units, plan=plan, ctx=ctx)
    assert {p.dtype for p in model.layers[0].parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.layers[1].parameters()} == {torch.float32}
    # A root in bf16 does not reach a unit whose rule sets nothing: float32, its own default.
    plan, ctx, units = planned({"strategy": "none"}, root={"strategy": "none", "storage_dtype": "bfloat16"})
    model = Toy()
    shard_levers.cast_storage(model, units, plan=plan, ctx=ctx)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.quick
def test_freeze_takes_exactly_the_units_params_out_of_training():
    plan, ctx, units = planned({"strategy": "none", "trainable": False})
    model = Toy()
    shard_levers.freeze(model, units, plan=plan, ctx=ctx)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"layers.0.{n}" for n, _ in model.layers[0].named_parameters()}
    assert ("shard.frozen", {"units": 1, "parameters": sum(p.numel() for p in model.layers[0].parameters())}) \
        in ctx.log.events


@pytest.mark.quick
@pytest.mark.parametrize("mode", ["full", "mlp"])
def test_recompute_checkpoints_the_unit_and_keeps_the_gradients(mode):
    from torch.distributed._composable import checkpoint

    plan, ctx, units = planned({"strategy": "none", "checkpoint": mode})
    model, reference = Toy(), Toy()
    shard_levers.recompute(model, units, plan=plan, ctx=ctx)
    wrapped = model.layers[0] if mode == "full" else model.layers[0].mlp
    assert checkpoint.state(wrapped) is not None
    assert checkpoint.state(model.layers[1]) is None and checkpoint.state(model.layers[1].mlp) is None
    assert_same_run(model, reference, torch.randn(2, 5, HIDDEN))
    # At inference (eval, generate: no backward) nothing is attached.
    plan, ctx, units = planned({"strategy": "none", "checkpoint": mode}, inference=True)
    model = Toy()
    shard_levers.recompute(model, units, plan=plan, ctx=ctx)
    assert checkpoint.state(model.layers[0]) is None and checkpoint.state(model.layers[0].mlp) is None


@pytest.mark.quick
def test_tiled_mlp_gives_the_untiled_outputs_and_gradients():
    plan, ctx, units = planned({"strategy": "none", "mlp_tile_tokens": 2})
    model, reference = Toy(), Toy()
    shard_levers.tiled_mlp(model, units, plan=plan, ctx=ctx)
    assert model.layers[0].mlp._forward_hooks and not model.layers[1].mlp._forward_hooks
    assert ("shard.tiled_mlp", {"modules": 1}) in ctx.log.events
    out, dx, grads = forward_backward(model, x := torch.randn(2, 7, HIDDEN))
    ref_out, ref_dx, ref_grads = forward_backward(reference, x)
    torch.testing.assert_close(out, ref_out)  # (a matmul of fewer rows may round otherwise on the CPU)
    torch.testing.assert_close(dx, ref_dx)
    for name, grad in grads.items():  # weight gradients: sums over tiles, in another order
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.quick
def test_offload_activations_moves_the_units_input_and_keeps_the_gradients():
    plan, ctx, units = planned({"strategy": "none", "checkpoint": "full", "offload_activations": True})
    model, reference = Toy(), Toy()
    shard_levers.recompute(model, units, plan=plan, ctx=ctx)
    shard_levers.offload_activations(model, units, plan=plan, ctx=ctx)
    assert model.layers[0]._forward_pre_hooks and not model.layers[1]._forward_pre_hooks
    assert ("shard.offload_activations", {"units": 1, "keep_every": 1}) in ctx.log.events
    assert_same_run(model, reference, torch.randn(2, 5, HIDDEN))


@pytest.mark.quick
def test_compile_wraps_the_units_children_and_skips_a_tiled_mlp():
    plan, ctx, units = planned({"strategy": "none", "compile": True})
    model = Toy()
    shard_levers.compile_lever(model, units, plan=plan, ctx=ctx)
    block = model.layers[0]
    assert block.mlp._compiled_call_impl is not None and block._compiled_call_impl is None
    assert block.self_attn._compiled_call_impl is None  # no attention in the Plan: not known to trace
    assert all(m._compiled_call_impl is None for m in model.layers[1].modules())
    assert ("shard.compile", {"modules": 1}) in ctx.log.events
    plan, ctx, units = planned({"strategy": "none", "compile": True, "mlp_tile_tokens": 4})
    model = Toy()
    assert shard_levers.compile_units(model, units, plan=plan) == (0, [])  # the MLP runs tile by tile: eager


@pytest.mark.quick
def test_float8_swaps_the_units_linear_layers():
    pytest.importorskip("torchao")
    plan, ctx, units = planned({"strategy": "none", "matmul": "float8", "float8_emulate": True})
    model = Toy()
    shard_levers.float8(model, units, plan=plan, ctx=ctx)
    assert type(model.layers[0].mlp.up).__name__ == "Float8Linear"
    assert type(model.layers[1].mlp.up) is torch.nn.Linear
    assert ("shard.float8", {"layers": 3}) in ctx.log.events
    plan, ctx, units = planned({"strategy": "none", "matmul": "float8"})
    with pytest.raises(PlanError, match="no float8 matrix units"):
        shard_levers.float8(Toy(), units, plan=plan, ctx=ctx)


@contextlib.contextmanager
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.quick
def test_fsdp2_shards_the_units_whose_params_say_so_and_the_root():
    from torch.distributed.tensor import DTensor

    from weft.core.mesh import build_device_mesh

    plan, ctx, units = planned({"strategy": "fsdp2", "reduce_dtype": "float32"}, root={"strategy": "fsdp2"})
    assert [shard_fsdp2.sharded(u) for u in units] == [True, True, False]
    model = Toy()
    with one_rank_group():
        mesh = build_device_mesh(plan.mesh, device_type="cpu")
        shard_fsdp2.quantize_before_sharding(model, units, plan=plan, mesh=mesh, ctx=ctx)  # no 4-bit unit: no-op
        shard_fsdp2.fsdp2(model, units, plan=plan, mesh=mesh, ctx=ctx)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert type(model.layers[0]).__name__.startswith("FSDP") and not type(model.layers[1]).__name__.startswith(
            "FSDP")  # layers.1 ('none') joined the root's group
    assert ("shard.fsdp2", {"units": 1, "mesh": [1, 1, 1, 1]}) in ctx.log.events


@pytest.mark.quick
def test_fsdp2_checks_the_root_and_the_storage_dtypes():
    plan, ctx, units = planned({"strategy": "fsdp2"})  # the root 'none'
    with pytest.raises(PlanError, match=r"\['layers.0'\]... use fsdp2 but the root uses 'none'"):
        shard_fsdp2.check_root(units, plan=plan)
    plan, ctx, units = planned({"strategy": "none", "storage_dtype": "bfloat16"}, root={"strategy": "fsdp2"})
    with pytest.raises(PlanError, match="unit 'layers.0' keeps its weights whole .* in bfloat16, inside an FSDP2 root"):
        shard_fsdp2.check_storage(units, plan=plan)
    plan, ctx, units = planned({"strategy": "fsdp2", "storage_dtype": "bfloat16"}, root={"strategy": "fsdp2"})
    shard_fsdp2.check_storage(units, plan=plan)  # a sharded unit keeps its own dtype


@pytest.mark.quick
def test_four_bit_units_are_materialised_once_before_sharding():
    """The 4-bit path and the core's share one function: the strategy materialises the model
    (quantising as it goes), and the core's call after the shard hook finds nothing to do."""
    from weft.core.train.weights import materialize_weights

    calls = []

    class Family:
        def materialize(self, model, recipe, **kwargs):
            calls.append(kwargs["quantize"])
            model.to_empty(device="cpu")

    plan, ctx, units = planned({"strategy": "fsdp2", "trainable": False, "quantize": "nf4"},
                               root={"strategy": "fsdp2"})
    ctx = attrs.evolve(ctx, family=Family())
    with torch.device("meta"):
        model = Toy()
    mesh = type("M", (), {"fsdp_mesh": lambda self: type("D", (), {"size": lambda self: 1})()})()
    shard_fsdp2.quantize_before_sharding(model, units, plan=plan, mesh=mesh, ctx=ctx)
    assert calls == [{"layers.0": "nf4"}] and ("shard.quantized_before_fsdp2", {"units": 1}) in ctx.log.events
    assert not materialize_weights(model, family=ctx.family, recipe=ctx.recipe, plan=plan, device=ctx.device,
                                   log=ctx.log)
    assert len(calls) == 1


LIGHT = textwrap.dedent('''
    [model]
    preset = "qwen2_text_tiny"
    [data]
    num_samples = 8
    [train]
    max_steps = 1
    micro_batch_tokens = 128
    checkpoint_every = 0
    [parallel]
    nproc = 1
    device = "cpu"
    [[rules]]
    name = "frozen first layer"
    when = { path = "model.layers.0" }
    shard = { strategy = "light", storage_dtype = "bfloat16", trainable = false, checkpoint = "full" }
    [[rules]]
    name = "recomputed layers"
    when = { path = "model.layers.*" }
    shard = { strategy = "light", storage_dtype = "bfloat16", checkpoint = "full" }
    [[rules]]
    name = "the whole model light"
    shard = { strategy = "light", storage_dtype = "bfloat16" }
''')


@pytest.fixture
def light_installed(tmp_path, monkeypatch):
    """tests/weft_light_shard.py discoverable as an installed distribution's entry point."""
    site = tmp_path / "site"
    info = site / "weft_light_shard-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weft-light-shard\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[weft]\nlight = weft_light_shard\n")
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    monkeypatch.syspath_prepend(str(site))
    for var in ("WEFT_PLUGINS", "WEFT_DISABLE_PLUGINS", "WEFT_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    import weft_light_shard

    weft_light_shard.SEEN.clear()
    yield weft_light_shard
    sys.modules.pop("weft_light_shard", None)


def test_a_third_party_shard_strategy_reuses_three_levers(light_installed, tmp_path, capsys):
    from torch.distributed._composable import checkpoint

    from weft.core.commands.main import main

    (tmp_path / "light.toml").write_text(LIGHT)
    run_dir = tmp_path / "run"
    assert main(["run", str(tmp_path / "light.toml"), "--run-dir", str(run_dir)]) == 0, capsys.readouterr().err[-3000:]
    (model,) = light_installed.SEEN
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # cast_storage, by every rule
    layers = model.model.layers
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == {
        f"model.layers.0.{n}" for n, _ in layers[0].named_parameters()}  # freeze
    assert all(checkpoint.state(layer) is not None for layer in layers)  # recompute
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())  # and nothing else
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert any(e["event"] == "shard.frozen" and e["units"] == 1 for e in events)
    assert any(e["event"] == "shard.checkpointing" and e["modules"] == len(layers) for e in events)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["state_gib"]["trainable_params"] < sum(
        p.numel() for p in model.parameters())


def test_the_built_in_hook_leaves_a_third_party_root_to_its_plugin(light_installed):
    """Each plugin's weft_shard applies only the strategies it declared."""
    from weft.plugins.shard import STRATEGIES, apply_root_strategy

    plan, ctx, units = planned({"strategy": "none", "trainable": False}, root={"strategy": "light"},
                                entry_points=True)
    model = Toy()
    apply_root_strategy(STRATEGIES, model=model, plan=plan, mesh=None, ctx=ctx)
    assert all(p.requires_grad for p in model.parameters()) and not light_installed.SEEN
    apply_root_strategy(light_installed.STRATEGIES, model=model, plan=plan, mesh=None, ctx=ctx)
    assert not any(p.requires_grad for p in model.layers[0].parameters()) and light_installed.SEEN == [model]



@pytest.mark.quick
def test_the_shard_plugins_never_compare_a_strategy_name_to_a_literal():
    """Which lever or sharding a unit gets follows from its params (and the root's strategy
    record), never from a strategy's name spelled out in the shard plugin's files."""
    import ast

    plugins = pathlib.Path(__file__).resolve().parents[1] / "plugins"
    found = []
    for path in sorted(plugins.glob("shard*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, (ast.Attribute, ast.Name)) and getattr(s, "attr", getattr(s, "id", None))
                        in ("strategy", "name") for s in sides)
            literal = any(isinstance(c, ast.Constant) and isinstance(c.value, str) for s in sides
                          for c in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", [])))
            if named and literal:
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
