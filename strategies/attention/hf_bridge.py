"""The bridge from weft's sequence-parallel attention to transformers' attention-function signature.

transformers calls ``fn(module, query, key, value, attention_mask, dropout=, scaling=, **kw)``
with (B, H, S, D) tensors and expects ((B, S, H, D), weights). The local
sequence is this rank's part, in the layout the batching produced; the padding
mask is not used (padding sits at the end of causal sequences and is masked out
of the loss; packed documents arrive with their own kernels).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from weft.strategies.attention.kernels.blocks import fa4_importable
from weft.strategies.attention.local import local_attention
from weft.strategies.attention.ring import ring_attention
from weft.strategies.attention.segment import segment_attention
from weft.strategies.attention.ulysses import ulysses_attention
from weft.strategies.attention.usp import usp_attention
from weft.strategies.attention.vision_ulysses import vision_ulysses_attention


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, q/k/v in the autocast dtype, as torch's SDPA would get them.

    Models apply rotary embeddings with float32 cos/sin, so q and k reach the attention
    function in float32 even in a bf16 autocast run; SDPA is on autocast's lower-precision
    list and casts them back, a custom function must do it itself. Without this the
    ring would pick float32 block kernels and Ulysses would send float32 over the wire.
    """
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def ulysses_inner(backend: str, *, packed: bool) -> Callable | None:
    """The attention Ulysses runs on its head slice of the whole sequence: torch's SDPA
    (None) unless a kernel is named or flash-attn-4 is installed. Packed documents keep
    SDPA with their mask."""
    if packed or (backend == "auto" and not fa4_importable()):
        return None
    return functools.partial(local_attention, backend=backend)


def ring_attend(*, layout: str, backend: str, ring_group: Any) -> Callable:
    """The ring's per-call attention: ``attend(query, key, value, *, causal, scale, doc_ids)``."""

    def attend(query, key, value, *, causal, scale, doc_ids):
        return ring_attention(query, key, value, group=ring_group, causal=causal, scale=scale, layout=layout,
                              backend=backend, doc_ids=doc_ids)

    return attend


def local_attend(*, backend: str) -> Callable:
    """One kernel on the whole local sequence (no sequence parallelism, no document ids)."""

    def attend(query, key, value, *, causal, scale, doc_ids):
        return local_attention(query, key, value, causal=causal, scale=scale, backend=backend)

    return attend


def ulysses_attend(*, backend: str, ulysses_group: Any) -> Callable:
    """Ulysses' all-to-all around the attention of its head slice (``ulysses_inner``)."""

    def attend(query, key, value, *, causal, scale, doc_ids):
        return ulysses_attention(query, key, value, group=ulysses_group, causal=causal, scale=scale, doc_ids=doc_ids,
                                 inner=ulysses_inner(backend, packed=doc_ids is not None))

    return attend


def usp_attend(*, layout: str, backend: str, ulysses_group: Any, ring_group: Any) -> Callable:
    """Ulysses inside, the ring outside."""

    def attend(query, key, value, *, causal, scale, doc_ids):
        return usp_attention(query, key, value, ulysses_group=ulysses_group, ring_group=ring_group, causal=causal,
                             scale=scale, layout=layout, backend=backend, doc_ids=doc_ids)

    return attend


def make_attention_function(*, name: str, attend: Callable) -> Callable:
    """transformers' attention signature around ``attend`` (one of the ``*_attend`` above, chosen
    once by the caller for the binding): ``attend(query, key, value, *, causal, scale, doc_ids)``
    on (B, H, S_local, D) tensors. ``name``: the strategy, for error messages."""

    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ):
        if dropout:
            raise ValueError(
                f"{name} attention does not implement attention dropout "
                f"(module {type(module).__name__}, dropout={dropout})"
            )
        if kwargs.get("sliding_window"):
            raise ValueError(
                f"{name} attention does not implement sliding-window attention (module {type(module).__name__})"
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # Packed documents: weft's batching passes the whole sequence's document ids as a
        # model input, which transformers hands on to every attention call.
        docs = kwargs.get("weft_doc_ids")
        query, key, value = autocast_inputs(query, key, value)
        out = attend(query, key, value, causal=causal, scale=scaling, doc_ids=docs)
        return out.transpose(1, 2).contiguous(), None  # (B, S_local, H, D)

    return attention


def make_vision_attention_function(*, group: Any, rank: int, world: int) -> Callable:
    """For a vision tower whose attention name contains "flash": transformers then passes
    the whole patch sequence with ``cu_seq_lens_q`` (and the longest segment as
    ``max_length_q``) to one call per block. When the sequence arrives split over the SP
    ranks (fewer local patches than ``cu_seq_lens_q`` covers), the ranks attend together
    with Ulysses; otherwise this rank attends its own images alone, all windows in one
    flash-attn-4 call where it runs (``segment_attention``). ``world == 1``: one rank,
    never split (no host sync to find out)."""

    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ):
        cu_seqlens = kwargs["cu_seq_lens_q"]
        max_seqlen = kwargs.get("max_length_q")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        query, key, value = autocast_inputs(query, key, value)
        if world > 1 and query.shape[2] < int(cu_seqlens[-1]):
            out = vision_ulysses_attention(query, key, value, cu_seqlens=cu_seqlens, group=group, rank=rank,
                                           world=world, scale=scale, max_seqlen=max_seqlen)
        else:
            out = segment_attention(query, key, value, cu_seqlens=cu_seqlens, scale=scale, max_seqlen=max_seqlen)
        return out.transpose(1, 2).contiguous(), None  # (1, S_part, H, D)

    return attention
