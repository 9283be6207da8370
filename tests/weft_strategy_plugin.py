"""Test-only: a third-party shard strategy and grad-sync strategy, each declared in one place (its
Strategy record), that the planner estimates, `weft check` compares and a run runs like the built-ins.

- shard ``whole``: every module kept whole on every rank (``shard_dims = ()``: it shards over
  nothing, so the estimate counts its weights, gradients and states whole, and no gathers);
- grad_sync ``scale``: averages the gradients no FSDP unit reduced (in one flat buffer of them),
  measures the global norm, then multiplies every gradient by ``factor`` (sign-preserving). Its
  record says what it adds to the estimate (that buffer, and its all-reduce's time) and what
  `weft check` should expect after it (the reference's gradients times ``factor``).
"""

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import Declared, NoParams, Strategy


@attrs.frozen(kw_only=True)
class ScaleParams:
    factor: float = 0.5


def _keep_whole(params, *, model, unit, ctx):
    # Nothing to wrap: the module's weights stay where the core puts them, whole on every rank.
    ctx.log.info("whole.kept", unit=unit or "(root)")


def _replicated_bytes(units, setup) -> float:
    """The gradients kept whole on a rank of several, in their storage dtype: what the flat
    all-reduce buffer holds (none on one rank: nothing to average)."""
    if setup.ranks(("dp_replicate", "dp_shard", "ring", "ulysses")) == 1:
        return 0.0
    return sum((u.params * u.trainable + u.adapter_params) * u.storage_bytes for u in units
               if setup.ranks(u.shard_dims) == 1)


def _scale(params, *, model, plan, mesh, ctx):
    from weft.strategies.optim.grad_norm import average_replicated_grads, clip_global_norm

    grads = [p for p in model.parameters() if p.grad is not None]
    average_replicated_grads(grads, world_size=ctx.world_size)
    norm = clip_global_norm(grads, max_norm=0.0, device=ctx.device)  # measured, not clipped
    for p in grads:
        p.grad.mul_(params.factor)
    return [("grad_norm", norm)]


WHOLE = Strategy(point="shard", name="whole", params=NoParams, impl=_keep_whole, shard_dims=(),
                 summary="test: every module whole on every rank")
SCALE = Strategy(point="grad_sync", name="scale", params=ScaleParams, impl=_scale,
                 reference=lambda params, *, grads, norm: {n: g * params.factor for n, g in grads.items()},
                 estimate_memory=lambda params, *, units, shape, setup: {
                     "grad sync buffer": _replicated_bytes(units, setup)},
                 estimate_time=lambda params, *, units, shape, setup, gpu: {
                     "grad sync": 2 * _replicated_bytes(units, setup) / (gpu.link_gbps * 1e9)},
                 summary="test: average, measure, then scale every gradient by factor")
STRATEGIES = Declared(WHOLE, SCALE)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_shard(model, plan, mesh, ctx):
    for m in plan.modules_for("shard"):
        strategy = STRATEGIES.of(m.get("shard"))
        if strategy is not None:
            strategy.impl(m.get("shard").params, model=model, unit=m.info.path, ctx=ctx)


@hookimpl
def weft_grad_sync(model, plan, mesh, ctx):
    found = []
    for decision in plan.decisions_of("grad_sync"):
        strategy = STRATEGIES.of(decision)
        if strategy is not None:
            found += strategy.impl(decision.params, model=model, plan=plan, mesh=mesh, ctx=ctx)
    return found or None
