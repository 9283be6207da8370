"""Split a tensor along its sequence dimension for sequence parallelism, and put it back.

Layouts:
- ``contiguous``: rank r holds chunk r of W equal chunks.
- ``zigzag`` (head-tail): the sequence is cut into 2W chunks and rank r holds
  chunks r and 2W-1-r, so under a causal mask every rank has the same work.
- USP: zigzag over the ring ranks, then each ring rank's part cut contiguously
  over its Ulysses ranks (``usp_shard``), matching what Ulysses' all-to-all
  gathers back before the ring runs.

``shard_sequence`` and ``unshard_sequence`` are exact inverses.
"""

from __future__ import annotations

import torch

LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


def required_multiple(*, world: int, layout: str) -> int:
    """The sequence length must be a multiple of this."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; accepted: {', '.join(LAYOUTS)}")
    return 2 * world if layout == "zigzag" else world


def check_divisible(seq_len: int, *, world: int, layout: str, what: str = "sequence") -> None:
    multiple = required_multiple(world=world, layout=layout)
    if seq_len % multiple:
        pad = -seq_len % multiple
        raise ValueError(
            f"{what} length {seq_len} is not divisible by {multiple} "
            f"({'2 x ' if layout == 'zigzag' else ''}{world} ranks, {layout} layout); "
            f"pad it by {pad} to {seq_len + pad} (weft's batching pads and masks the padding out of the loss)"
        )


def chunk_ids(*, rank: int, world: int, layout: str) -> tuple[int, ...]:
    """Which of the ``required_multiple`` equal chunks rank ``rank`` holds, in order."""
    required_multiple(world=world, layout=layout)
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def shard_sequence(x: torch.Tensor, *, dim: int, rank: int, world: int, layout: str) -> torch.Tensor:
    check_divisible(x.shape[dim], world=world, layout=layout)
    chunks = x.chunk(required_multiple(world=world, layout=layout), dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank=rank, world=world, layout=layout)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], *, dim: int, layout: str) -> torch.Tensor:
    """Reassemble the whole sequence from every rank's part (``parts[r]`` from rank r)."""
    world = len(parts)
    per_rank = len(chunk_ids(rank=0, world=world, layout=layout))
    chunks: list[torch.Tensor | None] = [None] * required_multiple(world=world, layout=layout)
    for rank, part in enumerate(parts):
        for piece, index in zip(part.chunk(per_rank, dim=dim), chunk_ids(rank=rank, world=world, layout=layout)):
            chunks[index] = piece
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def sequence_index(seq_len: int, *, rank: int, world: int, layout: str) -> torch.Tensor:
    """Global positions of this rank's tokens: ``shard_sequence(arange(seq_len))``."""
    return shard_sequence(torch.arange(seq_len), dim=0, rank=rank, world=world, layout=layout)


def usp_shard(
    x: torch.Tensor, *, dim: int, ring_rank: int, ring: int, ulysses_rank: int, ulysses: int, layout: str
) -> torch.Tensor:

    """USP split: ``layout`` over the ring ranks, then contiguous over the Ulysses ranks."""
    part = shard_sequence(x, dim=dim, rank=ring_rank, world=ring, layout=layout)
    check_divisible(part.shape[dim], world=ulysses, layout="contiguous", what="per-ring-rank sequence")
    return shard_sequence(part, dim=dim, rank=ulysses_rank, world=ulysses, layout="contiguous")


def usp_unshard(parts: list[list[torch.Tensor]], *, dim: int, layout: str) -> torch.Tensor:
    """Inverse of ``usp_shard``: ``parts[ring_rank][ulysses_rank]``."""
    ring_parts = [torch.cat(row, dim=dim) for row in parts]
    return unshard_sequence(ring_parts, dim=dim, layout=layout)


def usp_multiple(*, ring: int, ulysses: int, layout: str) -> int:
    return required_multiple(world=ring, layout=layout) * ulysses
