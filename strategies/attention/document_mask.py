"""Which keys a query may attend to when several documents share one sequence (packing).

Attention's own concern (ring and Ulysses build it per block from the document ids of the
rows they hold); the data side that packs documents is strategies/data/packing.py.
"""

from __future__ import annotations

import torch


def document_mask(
    doc_q: torch.Tensor, doc_k: torch.Tensor, idx_q: torch.Tensor, idx_k: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    """(B, 1, Sq, Sk) True where query i may attend key j: same document, and j <= i if causal.

    doc_*: (B, S*) document ids of the rows; idx_*: (S*,) their global positions.
    """
    mask = doc_q[:, :, None] == doc_k[:, None, :]  # (B, Sq, Sk)
    if causal:
        mask = mask & (idx_q[:, None] >= idx_k[None, :])
    return mask[:, None]
