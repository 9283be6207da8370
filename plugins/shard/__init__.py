"""Shard hook: the root's shard strategy applied to the model: FSDP2 per unit with per-group
precision, or no sharding; either runs the levers first (plugins/shard/levers.py)."""

from __future__ import annotations

from weft.core.hookspecs import hookimpl
from weft.core.registry import Declared, Strategy
from weft.plugins.shard.float8_units import describe
from weft.plugins.shard.fsdp2_steps import check_root, check_storage, fsdp2, quantize_before_sharding
from weft.plugins.shard.levers import apply_levers
from weft.plugins.shard.params import Fsdp2Params, KeepParams, check_keep


def apply_sharded(model, units, *, plan, mesh, ctx) -> None:
    """``fsdp2``: the levers, the 4-bit units quantised, then ``fully_shard`` per unit and the root."""
    check_storage(units, plan=plan)
    apply_levers(model, units, plan=plan, ctx=ctx)
    quantize_before_sharding(model, units, plan=plan, mesh=mesh, ctx=ctx)
    fsdp2(model, units, plan=plan, mesh=mesh, ctx=ctx)


def apply_whole(model, units, *, plan, mesh, ctx) -> None:
    """``none``: the levers; every rank keeps the whole model."""
    apply_levers(model, units, plan=plan, ctx=ctx)


STRATEGIES = Declared(
    Strategy(point="shard", name="fsdp2", params=Fsdp2Params,
             impl=apply_sharded,
             summary="FSDP2 fully_shard per unit over dp_shard x SP ranks", check=check_keep, describe=describe,
             shard_dims=("dp_shard", "ring", "ulysses"),
             gathers=True),
    Strategy(point="shard", name="none", params=KeepParams,
             impl=apply_whole,
             summary="keep the module whole on every rank; grad_sync averages its gradients", check=check_keep,
             describe=describe,
             shard_dims=()),
)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_shard(model, plan, mesh, ctx):
    apply_root_strategy(STRATEGIES, model=model, plan=plan, mesh=mesh, ctx=ctx)


def apply_root_strategy(declared: Declared, *, model, plan, mesh, ctx) -> None:
    """The root's shard strategy's ``impl``, where ``declared`` holds it (the calling plugin's
    own, so each plugin's ``weft_shard`` applies only what it declared), over every module with
    a shard decision: the strategy of the root shapes the whole model."""
    units = plan.modules_for("shard")
    check_root(units, plan=plan)  # FSDP2 units under a root no FSDP2 strategy shards, whoever's it is
    chosen = declared.of(plan.root().get("shard"))
    if chosen is not None and chosen.impl is not None:
        chosen.impl(model, units, plan=plan, mesh=mesh, ctx=ctx)
