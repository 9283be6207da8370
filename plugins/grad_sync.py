"""Grad-sync hook: average gradients FSDP did not reduce, then measure and clip the global norm."""

from __future__ import annotations

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.schema import in_range
from weft.core.registry import Strategy


@attrs.frozen(kw_only=True)
class ClipParams:
    max_norm: float = attrs.field(default=1.0, validator=in_range(low=0.0),
                                  metadata={"doc": "clip the global L2 norm to this; 0 = measure only"})


@hookimpl
def weft_strategies():
    return [Strategy(point="grad_sync", name="clip", params=ClipParams,
                     summary="all-reduce replicated grads, global L2 norm over the whole mesh, clip")]


@hookimpl
def weft_grad_sync(model, plan, mesh, ctx):
    decision = next((d for d in plan.decisions_of("grad_sync") if d.strategy == "clip"), None)
    if decision is None:
        return None
    from weft.strategies.optim.grad_norm import average_replicated_grads, clip_global_norm

    params = [p for p in model.parameters() if p.grad is not None]
    average_replicated_grads(params, world_size=ctx.world_size)
    norm = clip_global_norm(params, max_norm=decision.params.max_norm, device=ctx.device)
    return [("grad_norm", norm)]
