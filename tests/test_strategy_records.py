"""A strategy lives in one place, its Strategy record: a third-party shard strategy and grad-sync
strategy (tests/weft_strategy_plugin.py) are estimated by `weft plan --estimate` from what their
records declare, and `weft check` compares them (the grad sync's ``reference``), like the built-ins."""

from __future__ import annotations

import json
import pathlib
import textwrap

import pytest

from weft.core.plan.estimate import GIB, memory
from weft.core.plan.gpus import GPUS
from weft.core.plan.step_time import step_seconds
from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _recipe(tmp_path: pathlib.Path, *, shard: str, preset: str = "qwen2_text_tiny", extra: str = "") -> pathlib.Path:
    path = tmp_path / f"{shard}.toml"
    path.write_text(textwrap.dedent(f'''
        [model]
        preset = "{preset}"
        {extra}
        [[rules]]
        shard = {{ strategy = "{shard}" }}
        grad_sync = {{ strategy = "scale", factor = 0.5 }}
    '''))
    return path


def _planned(recipe_path: pathlib.Path, *, world_size: int):
    import weft_strategy_plugin
    from weft.core.plan.estimate_inputs import contributions_of, setup_of, shape_of, units_of
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe

    pm = build_plugin_manager(entry_points=False, extra=[("weft-strategy-test", weft_strategy_plugin)])
    recipe = Recipe.from_toml(str(recipe_path))
    plan, model = plan_recipe(recipe, pm=pm, world_size=world_size)
    units = units_of(plan, model)
    return plan, units, shape_of(model, units), setup_of(recipe, plan), contributions_of(plan)


@pytest.mark.quick
def test_the_estimate_reads_a_third_party_shard_and_grad_sync_strategy_from_their_records(tmp_path):
    """qwen2_text_tiny (115,264 float32 parameters) on 2 data-parallel ranks. ``whole`` declares it
    shards over nothing: weights, gradients and AdamW states whole on each rank, nothing gathered
    or reduce-scattered; ``scale`` declares a flat buffer of those gradients and its all-reduce."""
    plan, units, shape, setup, extra = _planned(_recipe(tmp_path, shard="whole"), world_size=2)
    assert plan.mesh.dp_shard == 2 and {u.strategy for u in units} == {"whole"}
    assert all(u.shard_dims == () and not u.gathers for u in units)
    whole = 115_264 * 4
    mem = memory(units, shape, setup, extra=extra)
    assert mem["weights"] == mem["gradients"] == whole and mem["optimizer"] == 2 * whole
    assert mem["gathered"] == 0 and mem["communication"] == 0
    assert mem["grad sync buffer"] == whole  # what the record's estimate_memory declares
    assert mem["total"] == pytest.approx(memory(units, shape, setup)["total"] + whole)
    gpu = GPUS["h200"]
    step = step_seconds(units, shape, setup, gpu, extra=extra)
    assert step["communication"] == 0 and step["grad sync"] == 2 * whole / (gpu.link_gbps * 1e9)
    assert step["total"] == pytest.approx(step_seconds(units, shape, setup, gpu)["total"] + step["grad sync"])
    # fsdp2's record shards over dp_shard x SP and gathers: the same model, halved and gathered;
    # the grad sync's buffer is then empty (FSDP2 reduced every gradient).
    _, units, shape, setup, extra = _planned(_recipe(tmp_path, shard="fsdp2"), world_size=2)
    assert all(u.shard_dims == ("dp_shard", "ring", "ulysses") and u.gathers for u in units)
    mem = memory(units, shape, setup, extra=extra)
    assert mem["weights"] == whole / 2 and mem["gathered"] > 0 and mem["grad sync buffer"] == 0
    # One rank: nothing to average, nothing declared.
    _, units, shape, setup, extra = _planned(_recipe(tmp_path, shard="whole"), world_size=1)
    assert memory(units, shape, setup, extra=extra)["grad sync buffer"] == 0


def test_weft_plan_estimate_shows_the_records_contributions(tmp_path):
    """The command itself, the plugin found through its entry point: Qwen2.5-0.5B's figures."""
    from plugin_site import plugin_env

    env = plugin_env(tmp_path, module="weft_strategy_plugin", entry="weft-strategy-test")
    figures = {}
    for shard in ("whole", "fsdp2"):
        done = run_weft("plan", str(_recipe(tmp_path, shard=shard, preset="qwen2_5_0_5b")), "--estimate", "--json",
                        "--world-size", "2", env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        figures[shard] = json.loads(done.stdout)
    whole, fsdp2 = figures["whole"], figures["fsdp2"]
    mem = whole["memory_gib"]
    assert mem["grad sync buffer"] == mem["gradients"] == mem["weights"] > 1.0  # float32, whole on each rank
    assert mem["gathered"] == 0 and whole["step_s"]["communication"] == 0
    assert whole["step_s"]["grad sync"] == round(2 * mem["weights"] * GIB / (GPUS["h200"].link_gbps * 1e9), 3)
    assert fsdp2["memory_gib"]["weights"] == pytest.approx(mem["weights"] / 2, abs=0.01)
    assert fsdp2["memory_gib"]["grad sync buffer"] == 0 and fsdp2["memory_gib"]["gathered"] > 0
    table = run_weft("plan", str(_recipe(tmp_path, shard="whole", preset="qwen2_5_0_5b")), "--estimate",
                     "--world-size", "2", env=env, cwd=tmp_path)
    assert table.returncode == 0 and "grad sync buffer" in table.stdout and "grad sync" in table.stdout


def test_weft_check_compares_a_third_party_shard_and_grad_sync_strategy(tmp_path):
    """The tiny VL model kept whole on 2 ranks, its gradients scaled by 0.5 after the sync: weft
    check compares the gradients before and after it (the record's ``reference``), then it runs."""
    from plugin_site import plugin_env

    env = plugin_env(tmp_path, module="weft_strategy_plugin", entry="weft-strategy-test")
    recipe = _recipe(tmp_path, shard="whole", preset="qwen2_5_vl_tiny",
                     extra='[data]\nsource = "synthetic"\nnum_samples = 64\nmin_side = 28\nmax_side = 84\n'
                           '[train]\nmax_steps = 2\nwarmup_steps = 1\nmicro_batch_tokens = 1024\n')
    done = run_weft("check", str(recipe), "--world-size", "2", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["mesh"]["dp_shard"] == 2, result
    assert result["clipped_grad_max_rel_diff"] is not None and result["clipped_grad_max_rel_diff"] <= 1e-4, result
    assert result["grad_norm_rel_diff"] <= 1e-4 and {"vision", "text"} <= set(result["grad_max_rel_diff_by_group"])
    run = run_weft("run", str(recipe), "--run-dir", str(tmp_path / "run"), "--nproc", "2", env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
