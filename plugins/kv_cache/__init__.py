"""KV-cache hook: the cache object `weft generate` fills in its prefill and decodes from.

- ``dynamic``: transformers' DynamicCache, the whole sequence on each rank;
- ``sharded``: each sequence-parallel rank keeps the keys and values of its part of the
  prompt (as the SP prefill leaves them) and every W-th decoded token; decoding merges the
  ranks' partial attention by log-sum-exp (plugins/kv_cache/sharded.py);
- ``paged``: each layer's keys and values in two partitions, a vision pool sized by the
  prompt's images and videos and text pages written in place (``page_tokens`` rows each),
  split over the sequence-parallel ranks as ``sharded`` splits them; decoding merges the
  partitions and the ranks by log-sum-exp (plugins/kv_cache/paged.py);
- ``static``: every layer's keys and values preallocated to the prompt plus the new tokens
  and written in place, one process (plugins/kv_cache/static.py);
- ``auto`` (the default rules'): ``sharded`` when the plan splits the sequence, else ``static``
  (the cache a compiled, captured decoding step reads: 6.8x plain transformers' ``generate``
  at 128K on one H200, BENCHMARKS.md); resolved when the Plan is built, so `weft plan` and
  `weft generate` see the cache that runs.
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Declared, NoParams, Strategy


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


# Each strategy's ``impl(params, *, model, plan, mesh, ctx)`` -> the cache.

def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _auto(params, *, info, plan):
    """Resolved when the Plan is built: the sharded cache under sequence parallelism, else the static one."""
    return (SHARDED.name, NoParams()) if plan.mesh.sp > 1 else (STATIC.name, StaticParams())


def _unresolved(params, **_):
    from weft.core.errors import PlanError

    raise PlanError("kv_cache 'auto' reached generate unresolved; a Plan from weft.core.recipe.rule_engine.build_plan "
                    "resolves it to the cache that runs")


def _dynamic(params, *, model, plan, mesh, ctx):
    from transformers import DynamicCache

    return DynamicCache(config=_text_config(model))


def _static(params, *, model, plan, mesh, ctx):
    from weft.plugins.kv_cache.static import StaticCache

    # A core-made decision (a batch of prompts) may carry no params: the default kernel.
    params = params if isinstance(params, StaticParams) else StaticParams()
    return StaticCache(num_layers=_text_config(model).num_hidden_layers, kernel=params.decode_kernel,
                       compile_step=params.compile_step, device=ctx.device if ctx is not None else None,
                       prefill_chunk=params.prefill_chunk_tokens)


def _split(plan, mesh, model) -> dict:
    """What the caches split over the sequence-parallel ranks take: their group, rank and degree."""
    group = mesh.sp.get_group() if plan.mesh.sp > 1 else None
    return {"num_layers": _text_config(model).num_hidden_layers, "group": group,
            "rank": mesh.sp.get_local_rank() if group is not None else 0, "world": plan.mesh.sp if group else 1}


def _sharded(params, *, model, plan, mesh, ctx):
    from weft.plugins.kv_cache.sharded import ShardedCache

    return ShardedCache(**_split(plan, mesh, model))


def _paged(params, *, model, plan, mesh, ctx):
    from weft.plugins.kv_cache.paged import PagedCache

    return PagedCache(**_split(plan, mesh, model), page_tokens=params.page_tokens)


AUTO = Strategy(point="kv_cache", name="auto", params=NoParams, resolve=_auto, impl=_unresolved,
                summary="sharded under sequence parallelism, static otherwise")
DYNAMIC = Strategy(point="kv_cache", name="dynamic", params=NoParams, impl=_dynamic,
                   summary="transformers' DynamicCache, whole sequence on each rank")
SHARDED = Strategy(point="kv_cache", name="sharded", params=NoParams, impl=_sharded,
                   summary="each SP rank keeps its part of the sequence; decoding merges partial attention by LSE")
STATIC = Strategy(point="kv_cache", name="static", params=StaticParams, check=_one_process, impl=_static,
                  batched_prompts=True,
                  summary="preallocated to the prompt plus the new tokens, written in place; one process")
PAGED = Strategy(point="kv_cache", name="paged", params=PagedParams, impl=_paged,
                 summary="a vision pool and text pages per layer (split over SP ranks); merged by LSE")
STRATEGIES = Declared(AUTO, DYNAMIC, SHARDED, STATIC, PAGED)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_kv_cache(decision, model, plan, mesh, ctx):
    return STRATEGIES.answer(decision, model=model, plan=plan, mesh=mesh, ctx=ctx)
