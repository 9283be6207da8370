"""Grad-sync hook: average gradients FSDP did not reduce, then measure and clip the global norm."""

from __future__ import annotations

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Declared, Strategy


@attrs.frozen(kw_only=True)
class ClipParams:
    max_norm: float = attrs.field(default=1.0, validator=in_range(low=0.0),
                                  metadata={"doc": "clip the global L2 norm to this; 0 = measure only"})


def _clip(params, *, model, plan, mesh, ctx):
    from weft.strategies.optim.grad_norm import average_replicated_grads, clip_global_norm

    grads = [p for p in model.parameters() if p.grad is not None]
    average_replicated_grads(grads, world_size=ctx.world_size)
    norm = clip_global_norm(grads, max_norm=params.max_norm, device=ctx.device)
    return [("grad_norm", norm)]


def _clipped(params, *, grads, norm):
    """`weft check`: the unsharded model's gradients clipped alike (as strategies/optim/grad_norm.py clips)."""
    scale = min(1.0, params.max_norm / (norm + 1e-6)) if params.max_norm else 1.0
    return {name: g * scale for name, g in grads.items()}


STRATEGIES = Declared(
    Strategy(point="grad_sync", name="clip", params=ClipParams, impl=_clip, reference=_clipped,
             summary="all-reduce replicated grads, global L2 norm over the whole mesh, clip"),
)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_grad_sync(model, plan, mesh, ctx):
    mine = [(strategy, d) for d in plan.decisions_of("grad_sync") if (strategy := STRATEGIES.of(d)) is not None]
    if not mine:
        return None
    return [pair for strategy, d in mine for pair in strategy.impl(d.params, model=model, plan=plan, mesh=mesh,
                                                                     ctx=ctx)]
