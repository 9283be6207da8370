"""Split a multimodal sequence over the sequence-parallel ranks after the vision merge.

Two pieces, plain torch:

- ``TextSplit``: cuts the text decoder's inputs (embeddings or ids, the position ids
  computed on the whole sequence, the padding mask) down to this rank's part, in
  the layout the attention strategy expects (``sequence_shard.usp_shard``).
- Image spreading: whole images are assigned to the SP ranks, balanced by patch
  count (``assign_images``); each rank runs the vision tower on its own images and
  ``gather_rows`` reassembles every image's merged embeddings in the original
  order, with a backward that hands each rank the summed gradient of its images.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from weft.strategies.sequence.layout import usp_multiple, usp_shard


@attrs.frozen(kw_only=True)
class TextSplit:
    """This rank's place in the SP group: ring x ulysses, and the ring layout."""

    ring: int
    ring_rank: int
    ulysses: int
    ulysses_rank: int
    layout: str

    @property
    def multiple(self) -> int:
        """Sequence lengths must be a multiple of this (batching pads to it)."""
        return usp_multiple(ring=self.ring, ulysses=self.ulysses, layout=self.layout)

    def shard(self, x: torch.Tensor, *, dim: int) -> torch.Tensor:
        return usp_shard(
            x,
            dim=dim,
            ring_rank=self.ring_rank,
            ring=self.ring,
            ulysses_rank=self.ulysses_rank,
            ulysses=self.ulysses,
            layout=self.layout,
        )


    def split_decoder_inputs(self, kwargs: dict) -> dict:
        """The decoder's keyword inputs with every sequence-long tensor cut to this rank's part.

        Position ids are made (0..S-1 per row) when the caller gave none, so each
        rank's tokens keep their global positions.
        """
        out = dict(kwargs)
        source = out.get("inputs_embeds") if out.get("inputs_embeds") is not None else out.get("input_ids")
        if source is None:
            return out
        batch, seq = source.shape[0], source.shape[1]
        if out.get("position_ids") is None:
            out["position_ids"] = torch.arange(seq, device=source.device).expand(batch, seq)
        for key in ("inputs_embeds", "input_ids", "attention_mask"):
            if out.get(key) is not None:
                out[key] = self.shard(out[key], dim=1)  # (B, S, ...) -> (B, S_local, ...)
        out["position_ids"] = self.shard(out["position_ids"], dim=out["position_ids"].dim() - 1)  # (..., B, S_local)
        return out


def assign_images(patches: list[int], world: int) -> list[list[int]]:
    """Image indices per rank: largest first onto the least-loaded rank (ties: lowest rank).

    Deterministic, so every rank computes the same assignment without talking.
    Each rank's list is in ascending image order.
    """
    loads = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for index in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owned[rank].append(index)
        loads[rank] += patches[index]
    return [sorted(images) for images in owned]


class _GatherRows(torch.autograd.Function):
    """All ranks' row blocks (different lengths) concatenated in rank order."""

    @staticmethod
    def forward(ctx, local, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        rank = dist.get_rank(group)
        longest = max(sizes)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.offset = sum(sizes[:rank])
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad):
        # Every rank's loss used every rank's rows: sum the gradients, keep ours.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[ctx.offset : ctx.offset + ctx.sizes[rank]], None, None


def gather_rows(local: torch.Tensor, *, sizes: list[int], group) -> torch.Tensor:
    """(sizes[rank], ...) on each rank -> (sum(sizes), ...) on every rank, differentiable."""
    return _GatherRows.apply(local, sizes, group)
