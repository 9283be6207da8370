"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, attend, and back.

Each rank starts with all heads of its sequence part (B, H, S/P, D); after the
all-to-all it holds H/P heads of the whole sequence (B, H/P, S, D), runs any
attention on them (local SDPA, or ring attention for USP), and a second
all-to-all returns (B, H, S/P, D). Sequence parts are concatenated in the
group's rank order, so the input layout is contiguous over the group.

GQA: when the KV heads divide the degree they are split like the query heads;
when fewer KV heads than ranks (P % KV == 0), each KV head is replicated P/KV
times before the exchange, so every rank receives the one its query heads
use; autograd sums the replicas' gradients back. Other head counts are
rejected: weft's plan checks them before a run starts.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _AllToAll(torch.autograd.Function):
    """Split ``scatter_dim`` over the group, gather ``gather_dim``; backward is the reverse."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.config = (group, scatter_dim, gather_dim)
        world = dist.get_world_size(group)
        if world == 1:
            return x
        inputs = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
        outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
        dist.all_to_all(outputs, inputs, group=group)
        return torch.cat(outputs, dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.config
        return _AllToAll.apply(grad, group, gather_dim, scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, S/P, D) -> (B, H/P, S, D)."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H/P, S, D) -> (B, H, S/P, D)."""
    return _AllToAll.apply(x, group, 2, 1)


def check_heads(*, heads: int, kv_heads: int, degree: int) -> None:
    if heads % degree:
        raise ValueError(f"Ulysses degree {degree} does not divide the {heads} query heads")
    if kv_heads % degree and degree % kv_heads:
        raise ValueError(f"Ulysses degree {degree} and the {kv_heads} key/value heads: one must divide the other")


def local_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:


    """Plain SDPA on whole sequences, GQA included; inside each document when packed."""
    gqa = k.shape[1] != q.shape[1]
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    from weft.strategies.attention.document_mask import document_mask

    index = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    mask = document_mask(doc_ids, doc_ids, index, index, causal=causal)  # (B, 1, S, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    scale: float | None = None,
    inner: Callable[..., torch.Tensor] | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence split contiguously across ``group``.

    q: (B, H, S_local, D); k, v: (B, KV, S_local, D). ``inner(q, k, v, causal=, scale=)``
    attends the whole (or ring-local) sequence per head group; default: SDPA.
    Returns (B, H, S_local, D). Differentiable.
    """
    group = group if group is not None else dist.group.WORLD
    degree = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(heads=heads, kv_heads=kv_heads, degree=degree)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kv_heads < degree:
        # Each rank needs the one KV head its H/P query heads share.
        k = k.repeat_interleave(degree // kv_heads, dim=1)
        v = v.repeat_interleave(degree // kv_heads, dim=1)
    q_h, k_h, v_h = seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)  # (B, H/P, S, D)
    extra = {} if doc_ids is None else {"doc_ids": doc_ids}  # (B, S_global): packed documents
    out = (inner or local_sdpa)(q_h, k_h, v_h, causal=causal, scale=scale, **extra)
    return heads_to_seq(out, group)  # (B, H, S_local, D)
