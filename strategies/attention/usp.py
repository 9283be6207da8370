"""USP: Ulysses over the inner (same-host) ranks, ring attention over the outer ones.

The sequence is split zigzag (or contiguous) over the ring ranks, then each ring
rank's part contiguously over its Ulysses ranks (``sequence_shard.usp_shard``).
Ulysses' all-to-all turns a rank's (B, H, S/(U*R), D) into (B, H/U, S/R, D): the
ring rank's whole part for H/U heads, on which ring attention runs.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from weft.strategies.attention.ring import ring_attention
from weft.strategies.attention.ulysses import ulysses_attention


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
    causal: bool = True,
    scale: float | None = None,
    layout: str = "zigzag",
    backend: str = "auto",
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (B, H, S_local, D); k, v: (B, KV, S_local, D). Returns (B, H, S_local, D).

    ``doc_ids`` (B, S_global): packed documents; attention stays inside each.
    """
    inner = functools.partial(_ring_inner, group=ring_group, layout=layout, backend=backend)
    return ulysses_attention(q, k, v, group=ulysses_group, causal=causal, scale=scale, inner=inner, doc_ids=doc_ids)


def _ring_inner(q, k, v, *, causal, scale, group, layout, backend, doc_ids=None):
    return ring_attention(
        q, k, v, group=group, causal=causal, scale=scale, layout=layout, backend=backend, doc_ids=doc_ids
    )

