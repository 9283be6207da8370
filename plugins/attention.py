"""Attention hook: which function each attention module calls, via transformers' AttentionInterface."""

from __future__ import annotations

from weft.core.hookspecs import hookimpl
from weft.core.registry import AttentionBinding, NoParams, Strategy


@hookimpl
def weft_strategies():
    return [
        Strategy(point="attention", name="sdpa", params=NoParams, summary="torch SDPA on the whole local sequence (no sequence parallelism)"),
        Strategy(point="attention", name="eager", params=NoParams, summary="transformers' eager attention (reference; slow)"),
    ]


@hookimpl
def weft_attention(decision, module_path, plan, mesh, ctx):
    if decision.strategy in ("sdpa", "eager"):
        # Names transformers already registers: nothing to add to the interface.
        return AttentionBinding(name=decision.strategy)
    return None
