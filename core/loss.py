"""Next-token loss as a sum over label tokens, so the caller divides by the global count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over positions whose next token is labelled.

    logits: (B, S, V); labels: (B, S) aligned with the inputs (not shifted).
    Computed in float32: a bf16 log-softmax over a 152K vocabulary loses digits.
    """
    shifted = labels[:, 1:]  # (B, S-1): position t predicts token t+1
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), shifted.flatten(), ignore_index=IGNORE, reduction="sum")


def label_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != IGNORE).sum()
