"""KV-cache hook: the cache object `weft generate` fills in its prefill and decodes from.

- ``dynamic``: transformers' DynamicCache, the whole sequence on each rank;
- ``sharded``: each sequence-parallel rank keeps the keys and values of its part of the
  prompt (as the SP prefill leaves them) and every W-th decoded token; decoding merges the
  ranks' partial attention by log-sum-exp (plugins/sharded_cache.py);
- ``auto`` (the default rules'): ``sharded`` when the plan splits the sequence, else ``dynamic``.
"""

from __future__ import annotations

from weft.core.hookspecs import hookimpl
from weft.core.registry import NoParams, Strategy


@hookimpl
def weft_strategies():
    return [
        Strategy(point="kv_cache", name="auto", params=NoParams,
                 summary="sharded under sequence parallelism, dynamic otherwise"),
        Strategy(point="kv_cache", name="dynamic", params=NoParams,
                 summary="transformers' DynamicCache, whole sequence on each rank"),
        Strategy(point="kv_cache", name="sharded", params=NoParams,
                 summary="each SP rank keeps its part of the sequence; decoding merges partial attention by LSE"),
    ]


@hookimpl
def weft_kv_cache(decision, model, plan, mesh, ctx):
    strategy = decision.strategy
    if strategy == "auto":
        strategy = "sharded" if plan.mesh.sp > 1 else "dynamic"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if strategy == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=config)
    if strategy == "sharded":
        from weft.plugins.sharded_cache import ShardedCache

        group = mesh.sp.get_group() if plan.mesh.sp > 1 else None
        rank, world = (mesh.sp.get_local_rank(), plan.mesh.sp) if group is not None else (0, 1)
        return ShardedCache(num_layers=config.num_hidden_layers, rank=rank, world=world, group=group)
    return None
