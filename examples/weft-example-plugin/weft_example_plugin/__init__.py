"""An example weft plugin: a `guard` strategy that skips steps whose loss spikes.

Select it from a rule:

    [[rules]]
    guard = [{ strategy = "finite" }, { strategy = "loss_spike", factor = 4.0 }]

Installed with pip, it is found through the entry point ``example`` in the group
``weft`` (see pyproject.toml). Importing this module imports neither torch nor
transformers: plugins load before any process group exists.
"""

from __future__ import annotations

import math

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import Strategy, Verdict
from weft.core.schema import in_range

NAME = "loss_spike"


@attrs.frozen(kw_only=True)
class LossSpikeParams:
    """The rule parameters of ``loss_spike``; a rule's table is checked against these fields."""

    factor: float = attrs.field(
        default=4.0,
        validator=in_range(low=1.0),
        metadata={"doc": "skip a step whose loss exceeds factor x the running mean"},
    )
    max_consecutive_skips: int = attrs.field(
        default=5,
        validator=in_range(low=1),
        metadata={"doc": "abort after this many skipped steps in a row"},
    )


@attrs.define(kw_only=True)
class RunningMean:
    """Mean loss of the steps this guard let through; one per run, kept in ``state.memory``."""

    total: float = 0.0
    count: int = 0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1


@hookimpl
def weft_strategies():
    return [
        Strategy(
            point="guard",
            name=NAME,
            params=LossSpikeParams,
            summary="skip a step whose loss exceeds factor x the running mean of accepted steps",
        )
    ]


@hookimpl
def weft_guard(event, state, plan):
    # Collect-all hook: every guard plugin is called; answer only when a rule chose us.
    decision = next((d for d in plan.decisions_of("guard") if d.strategy == NAME), None)
    if decision is None or event != "step_end" or state.loss is None or not math.isfinite(state.loss):
        return None  # non-finite losses are the "finite" guard's business
    params: LossSpikeParams = decision.params
    # Running state lives in the step state's per-run memory (the loop carries it
    # from step to step), never in a module global: two runs in one process, or
    # two plugin managers in one test, must not share it. state.loss is already
    # reduced over all ranks, so every rank keeps the same mean and the same verdict.
    running = state.memory.setdefault(NAME, RunningMean())
    mean = running.mean
    if mean is not None and mean > 0 and state.loss > params.factor * mean:
        reason = f"loss {state.loss:.4g} > {params.factor:g} x running mean {mean:.4g}"
        if state.consecutive_skips + 1 >= params.max_consecutive_skips:
            return Verdict(
                action="abort", guard=NAME, reason=f"{reason} for {state.consecutive_skips + 1} steps in a row"
            )

        return Verdict(action="skip", guard=NAME, reason=reason)
    running.add(state.loss)  # a skipped spike never enters the mean
    return Verdict(action="continue", guard=NAME)
