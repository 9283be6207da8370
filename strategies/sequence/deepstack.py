"""DeepStack under sequence parallelism: which visual feature rows a rank keeps.

Qwen3-VL adds features from several ViT layers to the hidden states of its first
decoder layers at the image (and video) positions. Its text decoder receives them as
``visual_pos_masks`` (B, S), True at the visual positions of the whole sequence, and
``deepstack_visual_embeds``, one (N_visual, H) tensor per tapped layer whose rows
follow the visual positions in row-major (B, S) order: the order of
``hidden_states[visual_pos_masks]``.

After the sequence is cut, a rank holds a (B, S_local) part of the mask, and the
decoder reads its rows in the row-major order of that part. ``local_rows`` numbers
the whole mask's visual positions, cuts the numbers exactly like the sequence, and
reads them back in the local order: any layout (contiguous, zigzag's two chunks per
rank, USP's ring-then-Ulysses cut) comes out right because it is the same cut.
"""

from __future__ import annotations

from typing import Callable

import torch

#: ``shard(x, dim=1)``: this rank's part of a whole-sequence (B, S) tensor.
Shard = Callable[..., torch.Tensor]


def local_rows(mask: torch.Tensor, *, shard: Shard) -> torch.Tensor:
    """(N_local,) long: the rows of the whole (N_visual, H) features this rank's part holds.

    ``mask``: (B, S) bool over the whole sequence. The rows are in the order in which
    the decoder reads them on this rank, ``hidden_local[shard(mask, dim=1)]``.
    """
    if mask.dim() != 2:
        raise ValueError(f"visual_pos_masks must be (B, S), got shape {tuple(mask.shape)}")
    mask = mask.bool()
    # Row number of every visual position in row-major order; -1 elsewhere. A running
    # count rather than mask.sum(): no host sync.
    numbers = mask.flatten().long().cumsum(0).view_as(mask) - 1  # (B, S)
    order = torch.where(mask, numbers, torch.full_like(numbers, -1))  # (B, S)
    local = shard(order, dim=1)  # (B, S_local), same cut as the decoder's inputs
    return local[local >= 0]  # row-major over the local part


def select_rows(features: list[torch.Tensor], rows: torch.Tensor) -> list[torch.Tensor]:
    """Each (N_visual, H) tensor cut to (N_local, H); ``index_select`` keeps autograd, so the
    gradient of a whole-sequence feature is this rank's rows' and zero elsewhere."""
    return [f.index_select(0, rows.to(f.device)) for f in features]
