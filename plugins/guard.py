"""Guard hook: verdicts on each step. Built-in: skip steps with a non-finite loss or gradient."""

from __future__ import annotations

import math

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import Strategy, Verdict
from weft.core.schema import in_range


@attrs.frozen(kw_only=True)
class FiniteParams:
    max_consecutive_skips: int = attrs.field(default=5, validator=in_range(low=1),
                                             metadata={"doc": "abort after this many skipped steps in a row"})


@hookimpl
def weft_strategies():
    return [Strategy(point="guard", name="finite", params=FiniteParams,
                     summary="skip a step whose loss or grad norm is NaN/inf; abort after N in a row")]


@hookimpl
def weft_guard(event, state, plan, ctx):
    decision = next((d for d in plan.decisions_of("guard") if d.strategy == "finite"), None)
    if decision is None or event != "step_end":
        return None
    # state.loss and state.grad_norm are global values (already reduced over
    # the mesh), so every rank reaches the same verdict without a collective.
    values = {"loss": state.loss, "grad_norm": state.grad_norm}
    bad = [name for name, value in values.items() if value is not None and not math.isfinite(value)]
    if not bad:
        return Verdict(action="continue", guard="finite")
    if state.consecutive_skips + 1 >= decision.params.max_consecutive_skips:
        return Verdict(action="abort", guard="finite",
                       reason=f"{' and '.join(bad)} not finite for {state.consecutive_skips + 1} steps in a row")
    return Verdict(action="skip", guard="finite", reason=f"{' and '.join(bad)} not finite")
