"""A third-party shard strategy: the model kept whole on every rank, with three of weft's
levers (storage dtype, freezing, recomputation) and nothing else (tests/test_shard_levers.py)."""

from __future__ import annotations

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import Declared, Strategy
from weft.plugins.shard import apply_root_strategy
from weft.plugins.shard.levers import cast_storage, freeze, recompute
from weft.plugins.shard.params import Checkpoint, Dtype

SEEN: list = []  # the models it applied itself to, for the test to look at


@attrs.frozen(kw_only=True)
class LightParams:
    storage_dtype: Dtype | None = None  # the same fields as the built-in rules: the same levers
    trainable: bool = True
    checkpoint: Checkpoint = "off"


def apply(model, units, *, plan, mesh, ctx) -> None:
    for lever in (cast_storage, freeze, recompute):
        lever(model, units, plan=plan, ctx=ctx)
    SEEN.append(model)


STRATEGIES = Declared(Strategy(point="shard", name="light", params=LightParams, impl=apply,
                               summary="the whole model on every rank: storage dtype, freezing and recomputation only"))


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_shard(model, plan, mesh, ctx):
    apply_root_strategy(STRATEGIES, model=model, plan=plan, mesh=mesh, ctx=ctx)
