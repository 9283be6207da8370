"""examples/weft-example-plugin found through REAL entry-point discovery, without pip.

A ``*.dist-info`` folder with METADATA and entry_points.txt on sys.path is what pip
would leave behind; importlib.metadata (and so pluggy) reads it the same way.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import types

import pytest
import torch

from weft.core.commands import main as cli
from weft.core.context import RunContext, StepState
from weft.core.hookspecs import hookimpl
from weft.core.mesh_spec import MeshSpec
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import ModuleInfo, build_plan
from weft.core.registry import Verdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "weft-example-plugin"
DIST = "weft-example-plugin 0.1"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Make the example discoverable as the distribution weft-example-plugin 0.1."""
    site = tmp_path / "site"
    info = site / "weft_example_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weft-example-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[weft]\nexample = weft_example_plugin\n")
    monkeypatch.syspath_prepend(str(EXAMPLE))  # the package itself
    monkeypatch.syspath_prepend(str(site))  # its metadata (syspath_prepend also invalidates import caches)
    for var in ("WEFT_PLUGINS", "WEFT_DISABLE_PLUGINS", "WEFT_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    yield site
    sys.modules.pop("weft_example_plugin", None)


def spike_recipe(tmp_path: pathlib.Path, guard: str = '{ strategy = "loss_spike", factor = 2.0 }') -> pathlib.Path:
    path = tmp_path / "spiky.toml"
    path.write_text(
        '[model]\npreset = "qwen2_text_tiny"\n\n'
        "[[rules]]\n"
        'name = "skip loss spikes"\n'
        f"guard = {guard}\n"
    )
    return path


@pytest.mark.quick
def test_entry_point_is_loaded_with_its_distribution(installed):
    pm = build_plugin_manager()
    assert "example" in pm.plugin_names()
    assert pm.distribution_of("example") == DIST
    assert pm.distribution_of("weft.plugins.guard") == "weft (built-in)"
    strategy = pm.registry.get("guard", "loss_spike")
    assert strategy is not None and strategy.plugin == "example"
    from weft_example_plugin import LossSpikeParams

    assert strategy.params is LossSpikeParams and LossSpikeParams().factor == 4.0


@pytest.mark.quick
def test_weft_plugins_json_lists_it(installed, capsys):
    assert cli.main(["plugins", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert {"name": "example", "distribution": DIST, "error": None} in table["plugins"]
    guard_hook = next(h for h in table["hook_points"] if h["hook"] == "weft_guard")
    assert "example" in guard_hook["implemented_by"] and guard_hook["firstresult"] is False
    (spike,) = [s for s in table["strategies"] if s["name"] == "loss_spike"]
    assert spike["point"] == "guard" and spike["plugin"] == "example"
    assert {"name": "factor", "accepts": "a number", "default": 4.0}.items() <= spike["params"][0].items()


@pytest.mark.quick
def test_rule_selects_it_and_the_hook_calls_it(installed, tmp_path):
    pm = build_plugin_manager()
    recipe_path = spike_recipe(tmp_path)
    recipe = Recipe.from_toml(recipe_path)
    modules = [ModuleInfo(path="", class_name="Qwen2ForCausalLM", kind="root"),
               ModuleInfo(path="model.layers.0", class_name="Qwen2DecoderLayer", kind="unit", modality="text")]
    plan = build_plan(recipe=recipe, modules=modules, registry=pm.registry, mesh=MeshSpec(), world_size=1)
    (chosen,) = plan.decisions_of("guard")  # the recipe's rule wins over the default "finite"
    assert chosen.strategy == "loss_spike" and chosen.params.factor == 2.0
    assert chosen.source == f"{recipe_path}:4" and chosen.rule == "skip loss spikes"
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"))

    memory: dict = {}  # what the loop carries from step to step
    skips = 0

    def step(n: int, loss: float) -> Verdict:
        nonlocal skips
        verdicts = [v for v in pm.hook.weft_guard(
            event="step_end", state=StepState(step=n, loss=loss, consecutive_skips=skips, memory=memory),
            plan=plan, ctx=ctx) if v]
        verdict = Verdict.strongest(verdicts)
        skips = skips + 1 if verdict.action == "skip" else 0
        return verdict

    assert pm.hook.weft_guard(event="step_start", state=StepState(step=1, memory=memory), plan=plan, ctx=ctx) == []
    assert step(1, 1.0).action == "continue"  # no mean yet
    assert step(2, 1.2).action == "continue"  # mean 1.1
    spike = step(3, 5.0)
    assert (spike.action, spike.guard) == ("skip", "loss_spike") and "running mean 1.1" in spike.reason
    assert step(4, 2.1).action == "continue"  # below 2 x 1.1; the spike never entered the mean
    assert memory["loss_spike"].count == 3
    assert step(5, math.nan).action == "continue"  # non-finite is the finite guard's business

    # A second plan (another run) with fresh memory starts from no mean.
    other: dict = {}
    verdicts = pm.hook.weft_guard(event="step_end", state=StepState(step=1, loss=50.0, memory=other), plan=plan,
                                  ctx=ctx)
    assert [v.action for v in verdicts] == ["continue"] and memory["loss_spike"].count == 3

    # Persistent spikes abort after max_consecutive_skips.
    for n in range(6, 10):
        assert step(n, 100.0).action == "skip"
    assert step(10, 100.0).action == "abort"


@pytest.mark.quick
def test_weft_plan_explain_shows_the_rule(installed, tmp_path, capsys):
    recipe_path = spike_recipe(tmp_path, guard='[{ strategy = "finite" }, { strategy = "loss_spike", factor = 3.0 }]')
    assert cli.main(["plan", str(recipe_path), "--explain", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "loss_spike" in line)
    assert "factor=3.0" in line and f"{recipe_path}:4" in line and "skip loss spikes" in line
    assert any("finite(" in line and f"{recipe_path}:4" in line for line in out.splitlines())


@pytest.mark.quick
def test_unknown_param_is_refused_with_the_plugins_fields(installed, tmp_path, capsys):
    recipe_path = spike_recipe(tmp_path, guard='{ strategy = "loss_spike", facter = 2.0 }')
    assert cli.main(["plan", str(recipe_path), "--world-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "facter" in err and "did you mean 'factor'" in err and f"{recipe_path}:4" in err


@pytest.mark.quick
def test_allow_and_block_lists(installed, capsys, monkeypatch):
    assert "example" not in build_plugin_manager(block=["example"]).plugin_names()
    assert "example" not in build_plugin_manager(allow=[]).plugin_names()
    allowed = build_plugin_manager(allow=["example"])
    assert ("example" in allowed.plugin_names()
            and "weft.plugins.guard" in allowed.plugin_names())  # built-ins always load
    # A blocked built-in is gone too, and so are its strategies.
    no_finite = build_plugin_manager(block=["weft.plugins.guard"])
    assert (no_finite.registry.get("guard", "finite") is None
            and no_finite.registry.get("guard", "loss_spike") is not None)

    # The same through the environment, as `weft plugins` reads it.
    for var, value in (("WEFT_DISABLE_PLUGINS", "example"), ("WEFT_PLUGINS", "")):
        monkeypatch.setenv(var, value)
        assert cli.main(["plugins", "--json"]) == 0
        names = [p["name"] for p in json.loads(capsys.readouterr().out)["plugins"]]
        assert "example" not in names and "weft.plugins.guard" in names
        monkeypatch.delenv(var)
    monkeypatch.setenv("WEFT_PLUGINS", "example,other")
    assert cli.main(["plugins", "--json"]) == 0
    assert "example" in [p["name"] for p in json.loads(capsys.readouterr().out)["plugins"]]


def test_the_loop_carries_guard_memory_between_steps(installed, tmp_path):
    """A real (one-rank) run: the example's running mean sees every step, not just the last."""
    from weft.core.train.loop import train

    recipe_path = tmp_path / "run.toml"
    recipe_path.write_text(
        'include = ["rules/modality-groups.toml"]\n'
        '[model]\npreset = "qwen2_5_vl_tiny"\n'
        '[data]\nnum_samples = 24\nmax_side = 56\n'
        "[train]\nmax_steps = 3\nmicro_batch_tokens = 512\n"
        '[parallel]\nnproc = 1\ndevice = "cpu"\n'
        "[[rules]]\n"
        'guard = [{ strategy = "finite" }, { strategy = "loss_spike", factor = 100.0 }]\n'
    )
    seen: list[StepState] = []

    class Probe:
        @hookimpl
        def weft_guard(self, event, state):
            if event == "step_end":  # the loop's one StepState, as it stands at this step
                seen.append(types.SimpleNamespace(step=state.step, loss=state.loss, memory=state.memory))

    pm = build_plugin_manager(extra=[("probe", Probe())])
    summary = train(recipe=Recipe.from_toml(recipe_path), pm=pm, run_dir=tmp_path / "run", resume=False, console=False)
    assert summary["skipped_steps"] == 0
    assert [s.step for s in seen] == [1, 2, 3]
    assert len({id(s.memory) for s in seen}) == 1  # one dict for the whole run
    running = seen[-1].memory["loss_spike"]
    assert running.count == 3 and running.mean == pytest.approx(sum(s.loss for s in seen) / 3)


def _plant(site: pathlib.Path, *, module: str, entry: str, code: str, metadata: str | None) -> None:
    """A package and its dist-info (with or without METADATA) declaring ``entry`` in group weft."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(code)
    info = site / f"{module}-0.3.dist-info"
    info.mkdir()
    if metadata is not None:
        (info / "METADATA").write_text(metadata)
    (info / "entry_points.txt").write_text(f"[weft]\n{entry} = {module}\n")


@pytest.fixture
def planted(tmp_path, monkeypatch):
    site = tmp_path / "planted"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    for var in ("WEFT_PLUGINS", "WEFT_DISABLE_PLUGINS", "WEFT_TRACE_HOOKS"):
        monkeypatch.delenv(var, raising=False)
    yield site
    for name in ("weft_raising_plugin", "weft_bare_plugin"):
        sys.modules.pop(name, None)


@pytest.mark.quick
def test_a_plugin_whose_import_raises_is_named_and_left_out(planted, capsys):
    """A plugin module that raises on import (a missing dependency, a bug): left out with one
    warning naming the entry point, its distribution and the error's first line, as a plugin
    whose weft_strategies raises is; the built-ins load, `weft plugins` lists it as left out."""
    _plant(planted, module="weft_raising_plugin", entry="raising",
           code='raise RuntimeError("needs a library this machine lacks\\nsecond line of detail")\n',
           metadata="Metadata-Version: 2.1\nName: weft-raising-plugin\nVersion: 0.3\n")
    pm = build_plugin_manager()
    err = capsys.readouterr().err
    assert ("weft: plugin 'raising' (weft-raising-plugin 0.3) failed to import (weft_raising_plugin) and is left "
            "out: RuntimeError: needs a library this machine lacks") in err
    assert "second line" not in err and "Traceback" not in err
    assert "raising" not in pm.plugin_names() and pm.registry.get("attention", "ring") is not None

    assert cli.main(["plugins", "--json"]) == 0
    captured = capsys.readouterr()
    assert {"name": "raising", "distribution": "weft-raising-plugin 0.3",
            "error": "import: RuntimeError: needs a library this machine lacks"} in json.loads(captured.out)["plugins"]
    assert cli.main(["plugins"]) == 0
    assert "its import raised RuntimeError" in capsys.readouterr().out


@pytest.mark.quick
def test_a_plugin_without_metadata_is_named_by_its_module(planted):
    """A dist-info with entry_points.txt and no METADATA (a hand-made or damaged install): named
    by the entry point's module and 'unknown version', not '(None None)'."""
    _plant(planted, module="weft_bare_plugin", entry="bare", code="", metadata=None)
    pm = build_plugin_manager()
    assert "bare" in pm.plugin_names()
    assert pm.distribution_of("bare") == "module weft_bare_plugin, unknown version"
