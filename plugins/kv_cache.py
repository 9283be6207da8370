"""KV-cache hook: the cache object `weft generate` fills in its prefill and decodes from.

- ``dynamic``: transformers' DynamicCache, the whole sequence on each rank;
- ``sharded``: each sequence-parallel rank keeps the keys and values of its part of the
  prompt (as the SP prefill leaves them) and every W-th decoded token; decoding merges the
  ranks' partial attention by log-sum-exp (plugins/sharded_cache.py);
- ``paged``: each layer's keys and values in two partitions, a vision pool sized by the
  prompt's images and videos and text pages written in place (``page_tokens`` rows each),
  split over the sequence-parallel ranks as ``sharded`` splits them; decoding merges the
  partitions and the ranks by log-sum-exp (plugins/paged_cache.py);
- ``static``: every layer's keys and values preallocated to the prompt plus the new tokens
  and written in place, one process (plugins/static_cache.py);
- ``auto`` (the default rules'): ``sharded`` when the plan splits the sequence, else ``static``
  (the cache a compiled, captured decoding step reads: 6.8x plain transformers' ``generate``
  at 128K on one H200, BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.schema import in_range
from weft.core.registry import NoParams, Strategy


@hookimpl
def weft_strategies():
    return [
        Strategy(point="kv_cache", name="auto", params=NoParams,
                 summary="sharded under sequence parallelism, static otherwise"),
        Strategy(point="kv_cache", name="dynamic", params=NoParams,
                 summary="transformers' DynamicCache, whole sequence on each rank"),
        Strategy(point="kv_cache", name="sharded", params=NoParams,
                 summary="each SP rank keeps its part of the sequence; decoding merges partial attention by LSE"),
        Strategy(point="kv_cache", name="static", params=StaticParams, check=_one_process,
                 summary="preallocated to the prompt plus the new tokens, written in place; one process"),
        Strategy(point="kv_cache", name="paged", params=PagedParams,
                 summary="a vision pool and text pages per layer (split over SP ranks); merged by LSE"),
    ]


def _one_process(params, *, recipe, plan) -> str | None:
    if plan.mesh.sp > 1:
        return ("the static cache keeps the whole sequence on each process; with sequence parallelism "
                f"({plan.mesh.sp} ranks) use the sharded or paged cache")
    return None


def _chunk_tokens(instance, attribute, value) -> None:
    if value != "auto":
        in_range(low=0)(instance, attribute, value)


@attrs.frozen(kw_only=True)
class StaticParams:
    decode_kernel: Literal["auto", "triton", "split", "flash"] = attrs.field(default="auto", metadata={
        "doc": "the decode attention: triton (weft's split-KV kernel, each key and value read once; CUDA with "
               "Triton), split (the same split-KV in plain torch, any device), flash (flash-attn-4's split-KV "
               "forward; Blackwell GPUs, compute capability 10+), auto: triton where it runs, else split"})
    compile_step: bool = attrs.field(default=True, metadata={
        "doc": "on CUDA, the decoding step through torch.compile before its CUDA graph captures it (one trace over "
               "every layer: norms, rotary, casts and softmax fused; compiled at the first decoded token)"})
    prefill_chunk_tokens: int | Literal["auto"] = attrs.field(default="auto", validator=_chunk_tokens, metadata={
        "doc": "a prompt longer than this is prefilled in chunks of about this many tokens (an image or video "
               "never split), each attending to the cache so far: the prefill's activations a chunk's, not the "
               "prompt's; 0 = the whole prompt at once; auto: whole where the GPU's free memory holds its "
               "prefill, else the largest chunks that fit"})


@attrs.frozen(kw_only=True)
class PagedParams:
    page_tokens: int = attrs.field(default=256, validator=in_range(low=1), metadata={
        "doc": "rows of one text page: a full text buffer grows by a page (one copy per page_tokens tokens)"})


@hookimpl
def weft_kv_cache(decision, model, plan, mesh, ctx):
    strategy = decision.strategy
    if strategy == "auto":
        strategy = "sharded" if plan.mesh.sp > 1 else "static"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if strategy == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=config)
    if strategy == "static":
        from weft.plugins.static_cache import StaticCache

        # A core-made decision (a batch of prompts) may carry no params: the default kernel.
        params = decision.params if isinstance(decision.params, StaticParams) else StaticParams()
        return StaticCache(num_layers=config.num_hidden_layers, kernel=params.decode_kernel,
                           compile_step=params.compile_step, device=ctx.device if ctx is not None else None,
                           prefill_chunk=params.prefill_chunk_tokens)
    if strategy not in ("sharded", "paged"):
        return None
    group = mesh.sp.get_group() if plan.mesh.sp > 1 else None
    sp = {"num_layers": config.num_hidden_layers, "group": group,
          "rank": mesh.sp.get_local_rank() if group is not None else 0, "world": plan.mesh.sp if group else 1}
    if strategy == "sharded":
        from weft.plugins.sharded_cache import ShardedCache

        return ShardedCache(**sp)
    from weft.plugins.paged_cache import PagedCache

    return PagedCache(**sp, page_tokens=decision.params.page_tokens)
