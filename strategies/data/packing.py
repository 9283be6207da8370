"""Packing: several documents in one sequence, attention kept inside each document.

A packed micro-batch is one row (B = 1) of whole documents. Each token carries its
document id (``weft_doc_ids``, passed through the model's forward to the attention
functions); position ids restart with every document (3-D mRoPE ids computed per
document by the model's own rope-index function); targets are shifted inside each
document, so no document predicts the next one's first token. Padding is a document
of its own with no targets.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from weft.strategies.data.conversation import vision_keys

IGNORE = -100


def pack_documents(lengths: Sequence[int], *, budget: int, seed: int, epoch: int) -> Iterator[list[int]]:
    """Shuffled documents, first-fit into rows of at most ``budget`` tokens (sum, not padded),
    a window of documents at a time (token_budget.WINDOW buckets: the rows open to first-fit are
    those of one window, so a million documents cost a window's rows each, not all of them)."""
    from weft.strategies.data.token_budget import WINDOW, as_lengths, epoch_generator, shuffled_windows

    sizes = as_lengths(lengths)
    generator = epoch_generator("pack", seed=seed, epoch=epoch)
    for window in shuffled_windows(sizes, budget=budget, generator=generator, span=256 * WINDOW):
        rows: list[list[int]] = []
        room: list[int] = []
        for index, length in zip(window.tolist(), sizes[window].tolist()):
            for r, free in enumerate(room):
                if length <= free:
                    rows[r].append(index)
                    room[r] -= length
                    break
            else:
                rows.append([index])
                room.append(budget - length)
        yield from rows


def collate_packed(
    samples: Sequence, *, pad_id: int, pad_to_multiple_of: int = 1, positions: Callable
) -> dict[str, torch.Tensor]:
    """One packed row. ``positions(sample) -> (..., L)`` position ids of one document."""
    ids, targets, docs, types, pos = [], [], [], [], []
    for doc, sample in enumerate(samples):
        n = sample.num_tokens
        ids.append(sample.input_ids)
        shifted = torch.cat([sample.labels[1:], torch.tensor([IGNORE])])  # inside the document only
        targets.append(shifted)
        docs.append(torch.full((n,), doc))
        types.append(sample.mm_token_type_ids)
        pos.append(positions(sample))
    total = sum(s.num_tokens for s in samples)
    pad = -total % pad_to_multiple_of
    if pad:
        ids.append(torch.full((pad,), pad_id))
        targets.append(torch.full((pad,), IGNORE))
        docs.append(torch.full((pad,), len(samples)))  # padding attends only to itself
        types.append(torch.zeros(pad, dtype=torch.long))
        pos.append(torch.arange(pad).expand(*pos[0].shape[:-1], pad))
    out = {
        "input_ids": torch.cat(ids)[None],  # (1, S)
        "shift_labels": torch.cat(targets)[None],  # (1, S)
        "weft_doc_ids": torch.cat(docs)[None],  # (1, S)
        "position_ids": torch.cat(pos, dim=-1),  # (1, S) text; (3, 1, S) mRoPE
    }
    out.update(vision_keys(samples, mm_token_type_ids=torch.cat(types)[None]))  # images and videos, in order
    return out
