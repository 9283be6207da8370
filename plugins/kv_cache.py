"""KV-cache hook: the cache object used for generation and evaluation."""

from __future__ import annotations

from weft.core.hookspecs import hookimpl
from weft.core.registry import NoParams, Strategy


@hookimpl
def weft_strategies():
    return [Strategy(point="kv_cache", name="dynamic", params=NoParams,
                     summary="transformers' DynamicCache, whole sequence on each rank")]


@hookimpl
def weft_kv_cache(decision, model, plan, ctx):
    if decision.strategy != "dynamic":
        return None
    from transformers import DynamicCache

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return DynamicCache(config=config)
