"""Next-token loss as a sum over label tokens, so the caller divides by the global count.

A micro-batch carries either ``labels`` (aligned with the inputs; shifted here) or,
under sequence parallelism, ``shift_labels``: already shifted on the whole
sequence and then split like the inputs, so each rank's part predicts exactly the
tokens the unsharded model would (the last token of a rank's part predicts the
first token of the next part).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def targets(batch: dict) -> torch.Tensor:
    """(B, S_local) targets aligned with the logits' positions."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)  # position t predicts t+1


def token_loss_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions. logits (B, S, V); target (B, S).

    Computed in float32: a bf16 log-softmax over a 152K vocabulary loses digits.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE, reduction="sum")


def label_count(target: torch.Tensor) -> torch.Tensor:
    return (target != IGNORE).sum()
