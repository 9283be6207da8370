"""Guard hook: verdicts on each step.

Built-in: ``finite`` (skip steps with a non-finite loss or gradient), ``spike`` (a loss or
gradient norm far above the recent median: skip, warn or abort, by rule), ``memory``
(warn when a rank's GPU memory passes a share of the device, with allocated and reserved),
``update`` (the share of bf16 updates round-to-nearest would lose; warns when the optimizer
rounds to nearest and the share is large: the learning rate is too small for bf16 storage).
"""

from __future__ import annotations

import math
from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Declared, Strategy, Verdict


@attrs.frozen(kw_only=True)
class FiniteParams:
    max_consecutive_skips: int = attrs.field(default=5, validator=in_range(low=1),
                                             metadata={"doc": "abort after this many skipped steps in a row"})


@attrs.frozen(kw_only=True)
class SpikeParams:
    metric: Literal["loss", "grad_norm"] = attrs.field(default="loss", metadata={"doc": "the value watched"})
    ratio: float = attrs.field(default=3.0, validator=in_range(low=1.0), metadata={
        "doc": "a step whose value exceeds ratio x the median of the window is a spike"})
    window: int = attrs.field(default=50, validator=in_range(low=1),
                              metadata={"doc": "accepted steps the median is taken over"})
    warmup: int = attrs.field(default=10, validator=in_range(low=1),
                              metadata={"doc": "accepted steps seen before any step is judged"})
    action: Literal["skip", "warn", "abort"] = attrs.field(default="skip", metadata={
        "doc": "skip: no optimizer step for a spike; warn: log it and go on; abort: stop the run (exit 3)"})
    max_consecutive: int = attrs.field(default=5, validator=in_range(low=1), metadata={
        "doc": "with skip: abort after this many spikes in a row (the loss moved for good, not a spike)"})


@attrs.frozen(kw_only=True)
class MemoryParams:
    warn_fraction: float = attrs.field(default=0.9, validator=in_range(low=0.0, high=1.0), metadata={
        "doc": "warn when a rank's reserved GPU memory passes this share of the device's"})
    every: int = attrs.field(default=50, validator=in_range(low=1),
                             metadata={"doc": "steps between repeated warnings while it stays above"})


@attrs.frozen(kw_only=True)
class UpdateParams:
    every: int = attrs.field(default=200, validator=in_range(low=1), metadata={
        "doc": "steps between checks (and at step 2, the first with optimizer moments)"})
    warn_fraction: float = attrs.field(default=0.25, validator=in_range(low=0.0, high=1.0), metadata={
        "doc": "warn when more than this share of a group's sampled bf16 updates would be rounded away"})
    samples: int = attrs.field(default=1024, validator=in_range(low=1),
                               metadata={"doc": "elements sampled per tensor (strided)"})


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_guard(event, state, plan, ctx):
    if event != "step_end":
        return None
    # Each strategy's ``impl(params, state=, ctx=) -> Verdict``.
    verdicts = [strategy.impl(d.params, state=state, ctx=ctx) for d in plan.decisions_of("guard")
                if (strategy := STRATEGIES.of(d)) is not None]
    return Verdict.strongest(verdicts) if verdicts else None


def _finite(params: FiniteParams, *, state, ctx) -> Verdict:
    # state.loss and state.grad_norm are global values (already reduced over
    # the mesh), so every rank reaches the same verdict without a collective.
    values = {"loss": state.loss, "grad_norm": state.grad_norm}
    bad = [name for name, value in values.items() if value is not None and not math.isfinite(value)]
    if not bad:
        return Verdict(action="continue", guard="finite")
    if state.consecutive_skips + 1 >= params.max_consecutive_skips:
        return Verdict(action="abort", guard="finite",
                       reason=f"{' and '.join(bad)} not finite for {state.consecutive_skips + 1} steps in a row")
    return Verdict(action="skip", guard="finite", reason=f"{' and '.join(bad)} not finite")


def _spike(params: SpikeParams, *, state, ctx) -> Verdict:
    from weft.strategies.optim.loss_spike import SpikeWindow

    value = getattr(state, params.metric)
    if value is None or not math.isfinite(value):
        return Verdict(action="continue", guard="spike")  # the finite guard's case
    key = f"spike:{params.metric}"
    window = state.memory.setdefault(key, SpikeWindow(window=params.window, ratio=params.ratio,
                                                      warmup=params.warmup))
    median = window.judge(value)  # global values: every rank reaches the same verdict
    if median is None:
        return Verdict(action="continue", guard="spike")
    reason = f"{params.metric} {value:.4g} is {value / median:.1f}x the median {median:.4g} of the last " \
             f"{len(window.values)} steps"
    if params.action == "abort" or (params.action == "skip" and window.consecutive >= params.max_consecutive):
        extra = "" if params.action == "abort" else f" ({window.consecutive} spikes in a row)"
        return Verdict(action="abort", guard="spike", reason=reason + extra)
    if params.action == "warn":
        ctx.log.warning("guard.spike", step=state.step, metric=params.metric, value=value, median=median)
        return Verdict(action="continue", guard="spike", reason=reason)
    return Verdict(action="skip", guard="spike", reason=reason)


def _memory(params: MemoryParams, *, state, ctx) -> Verdict:
    import torch  # here, not at import: building the plugin manager imports no torch

    device = ctx.device
    if device.type != "cuda":
        return Verdict(action="continue", guard="memory")
    total = torch.cuda.get_device_properties(device).total_memory
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    last = state.memory.get("memory:warned")
    if reserved > params.warn_fraction * total and (last is None or state.step - last >= params.every):
        state.memory["memory:warned"] = state.step
        ctx.log.warning("guard.memory", step=state.step, rank=ctx.rank, reserved_gib=round(reserved / 2**30, 2),
                        allocated_gib=round(allocated / 2**30, 2), peak_gib=round(
                            torch.cuda.max_memory_allocated(device) / 2**30, 2), device_gib=round(total / 2**30, 2),
                        fraction=round(reserved / total, 3), warn_fraction=params.warn_fraction)
    return Verdict(action="continue", guard="memory")


def _update(params: UpdateParams, *, state, ctx) -> Verdict:
    optimizer = ctx.optimizer
    if optimizer is None or not (state.step == 2 or state.step % params.every == 0):
        return Verdict(action="continue", guard="update")
    from weft.strategies.optim.update_audit import lost_fractions

    # torch's AdamW (and any optimizer that does not say otherwise) rounds bf16 to nearest.
    rounding = getattr(optimizer, "bf16_rounding", "nearest")
    for index, fraction, sampled in lost_fractions(optimizer, per_tensor=params.samples):
        group = optimizer.param_groups[index]
        fields = {"step": state.step, "group": index, "rule": group.get("rule", "?"), "lr": float(group["lr"]),
                  "below_half_step": round(fraction, 4), "sampled": sampled, "rounding": rounding}
        if rounding == "nearest" and fraction > params.warn_fraction:
            ctx.log.warning("guard.update.lost", **fields, advice="round-to-nearest drops these updates: use the "
                            "optimizer 'adamw_sr' (stochastic rounding), or store these modules in float32")
        else:
            ctx.log.info("guard.update", **fields)
    return Verdict(action="continue", guard="update")


STRATEGIES = Declared(
    Strategy(point="guard", name="finite", params=FiniteParams, impl=_finite,
             summary="skip a step whose loss or grad norm is NaN/inf; abort after N in a row"),
    Strategy(point="guard", name="spike", params=SpikeParams, impl=_spike,
             summary="a loss (or grad norm) over ratio x the recent median: skip, warn or abort"),
    Strategy(point="guard", name="memory", params=MemoryParams, impl=_memory,
             summary="warn when a rank's GPU memory passes a share of the device (allocated, reserved)"),
    Strategy(point="guard", name="update", params=UpdateParams, impl=_update,
             summary="report the share of bf16 updates round-to-nearest loses; warn when the optimizer "
                     "rounds to nearest and it is large"),
)
