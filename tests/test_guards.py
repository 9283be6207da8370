"""The built-in guards beyond ``finite``: loss spikes by rule and the GPU memory watchdog.

Through the guard hook itself (the verdicts the loop acts on), with StepStates carrying
the values the loop reduces; the memory watchdog with torch.cuda's readings stood in for.
"""

from __future__ import annotations

import types

import pytest
import torch

from weft.core.context import StepState
from weft.core.errors import WeftError
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import Decision
from weft.plugins.guard import MemoryParams, SpikeParams, weft_guard
from weft.strategies.optim.loss_spike import SpikeWindow

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)


class _Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:
        self.warnings.append((event, kw))


def _plan(*params) -> types.SimpleNamespace:
    names = {SpikeParams: "spike", MemoryParams: "memory"}
    decisions = [Decision(point="guard", strategy=names[type(p)], params=p, source="t:1", rule="t") for p in params]
    return types.SimpleNamespace(decisions_of=lambda point: decisions if point == "guard" else [])


def _run(losses: list[float], params: SpikeParams) -> list:
    plan, ctx, memory = _plan(params), types.SimpleNamespace(log=_Log(), device=torch.device("cpu")), {}
    verdicts = []
    for step, loss in enumerate(losses, start=1):
        state = StepState(step=step, loss=loss, grad_norm=1.0, memory=memory)
        verdicts.append(weft_guard(event="step_end", state=state, plan=plan, ctx=ctx))
    return verdicts


def test_spike_over_the_median_is_skipped_and_not_learned():
    losses = [2.0, 2.1, 1.9, 2.0, 2.05, 9.0, 2.0, 8.5, 1.95]
    verdicts = _run(losses, SpikeParams(ratio=3.0, warmup=5, window=10))
    assert [v.action for v in verdicts] == ["continue"] * 5 + ["skip", "continue", "skip", "continue"]
    assert verdicts[5].guard == "spike" and "loss 9 is 4.5x the median 2 of the last 5 steps" in verdicts[5].reason


def test_spike_warmup_window_and_metric():
    # Within warmup nothing is judged; the window forgets old values; grad_norm is watched by rule.
    assert all(v.action == "continue" for v in _run([1.0, 50.0, 1.0], SpikeParams(warmup=3)))
    window = SpikeWindow(window=3, ratio=2.0, warmup=3)
    for value in (10.0, 10.0, 10.0, 1.0, 1.0, 1.0):  # the window slides down to 1.0
        assert window.judge(value) is None
    assert window.judge(2.5) == 1.0  # a spike against the recent median, not the old one
    plan = _plan(SpikeParams(metric="grad_norm", warmup=2))
    ctx, memory = types.SimpleNamespace(log=_Log(), device=torch.device("cpu")), {}
    got = [weft_guard(event="step_end", state=StepState(step=s, loss=5.0, grad_norm=g, memory=memory), plan=plan,
                      ctx=ctx).action for s, g in enumerate((1.0, 1.0, 9.0), start=1)]
    assert got == ["continue", "continue", "skip"]


def test_spike_actions():
    losses = [1.0] * 4 + [10.0, 10.0, 10.0]
    warn = _run(losses, SpikeParams(warmup=4, action="warn"))
    assert [v.action for v in warn] == ["continue"] * 7 and "median 1" in warn[4].reason
    abort = _run(losses, SpikeParams(warmup=4, action="abort"))
    assert abort[4].action == "abort" and abort[4].guard == "spike"
    # skip, then abort once the loss stays up: it moved for good.
    persistent = _run(losses, SpikeParams(warmup=4, max_consecutive=3))
    assert [v.action for v in persistent[4:]] == ["skip", "skip", "abort"]
    assert "3 spikes in a row" in persistent[6].reason


def test_non_finite_values_are_left_to_the_finite_guard():
    assert [v.action for v in _run([1.0, 1.0, float("nan"), 1.0], SpikeParams(warmup=2))] == ["continue"] * 4


def test_memory_watchdog_warns_with_allocated_and_reserved(monkeypatch):
    gib = 2**30
    device = types.SimpleNamespace(total_memory=100 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: device)
    reserved = {"now": 80 * gib}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved["now"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 70 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 91 * gib)
    log = _Log()
    ctx, memory = types.SimpleNamespace(log=log, device=torch.device("cuda", 0), rank=3), {}  # no GPU needed
    plan = _plan(MemoryParams(warn_fraction=0.9, every=3))
    for step in range(1, 9):
        reserved["now"] = (80 if step < 3 else 95) * gib
        verdict = weft_guard(event="step_end", state=StepState(step=step, memory=memory), plan=plan, ctx=ctx)
        assert verdict.action == "continue"
    assert [kw["step"] for _, kw in log.warnings] == [3, 6]  # above from step 3; again every 3 steps
    event, kw = log.warnings[0]
    assert event == "guard.memory" and kw["rank"] == 3 and kw["reserved_gib"] == 95.0
    assert kw["allocated_gib"] == 70.0 and kw["peak_gib"] == 91.0 and kw["fraction"] == 0.95


def test_guards_by_rule_in_a_recipe():
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "rules": [{"guard": [
        {"strategy": "finite"}, {"strategy": "spike", "ratio": 4.0, "action": "warn"},
        {"strategy": "memory", "warn_fraction": 0.85}]}]})
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager

    plan, _ = plan_recipe(recipe, pm=build_plugin_manager(entry_points=False), world_size=1)
    chosen = {d.strategy: d.params for d in plan.decisions_of("guard")}
    assert chosen["spike"] == SpikeParams(ratio=4.0, action="warn") and chosen["memory"].warn_fraction == 0.85
    bad = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"},
                            "rules": [{"guard": {"strategy": "spike", "ratio": 0.5}}]})
    with pytest.raises(WeftError, match="ratio = 0.5 is out of range"):
        plan_recipe(bad, pm=build_plugin_manager(entry_points=False), world_size=1)
