"""Ulysses over the patches of large images: the vision tower's blocks shared by the SP ranks.

The patch sequence of one vision call (all its images, in the tower's window
order) is cut into near-equal contiguous parts, one per SP rank. Inside each
attention call an all-to-all gives every rank all patches for H/P heads; it
attends within each segment of ``cu_seqlens`` (the windows of a window-attention
block, the images of a full-attention block), exactly as the tower would on one
rank, and a second all-to-all returns its own patches for all heads. Parts may
differ in length by one patch: they are padded to the longest for the exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weft.strategies.attention.segment import segment_attention
from weft.strategies.attention.ulysses import heads_to_seq, seq_to_heads


def part_sizes(total: int, world: int) -> list[int]:
    """Rows of each rank's part: the first ``total % world`` ranks take one more."""
    return [total // world + (1 if r < total % world else 0) for r in range(world)]


def vision_ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    group,
    rank: int,
    world: int,
    scale: float,
    max_seqlen: int | None = None,
) -> torch.Tensor:

    """q, k, v: (1, H, S_part, D), this rank's part of the patch sequence. Returns the same shape.

    ``cu_seqlens`` covers the whole patch sequence (all parts).
    """
    total = int(cu_seqlens[-1])
    sizes = part_sizes(total, world)
    if q.shape[2] != sizes[rank]:
        raise ValueError(f"vision part of {q.shape[2]} patches on rank {rank}; expected {sizes[rank]} of {total}")
    longest = max(sizes)
    # Rows of the whole sequence inside the padded exchange buffer (rank r at r * longest).
    rows = torch.cat([torch.arange(n, device=q.device) + r * longest for r, n in enumerate(sizes)])

    def gather(x):  # (1, H, S_part, D) -> (1, H/P, S, D)
        padded = F.pad(x, (0, 0, 0, longest - x.shape[2]))
        return seq_to_heads(padded, group).index_select(2, rows)

    out = segment_attention(gather(q), gather(k), gather(v), cu_seqlens=cu_seqlens, scale=scale,
                            max_seqlen=max_seqlen)  # (1, H/P, S, D)
    buffer = out.new_zeros((out.shape[0], out.shape[1], longest * world, out.shape[3])).index_copy(2, rows, out)
    return heads_to_seq(buffer, group)[:, :, : sizes[rank]]  # (1, H, S_part, D)
