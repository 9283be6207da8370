"""Next-token loss as a sum over label tokens, so the caller divides by the global count.

A micro-batch carries either ``labels`` (aligned with the inputs; shifted here) or,
under sequence parallelism, ``shift_labels``: already shifted on the whole
sequence and then split like the inputs, so each rank's part predicts exactly the
tokens the unsharded model would (the last token of a rank's part predicts the
first token of the next part).
"""

from __future__ import annotations

import torch

IGNORE = -100


def targets(batch: dict) -> torch.Tensor:
    """(B, S_local) targets aligned with the logits' positions."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)  # position t predicts t+1


def token_loss_sum(logits: torch.Tensor, target: torch.Tensor, *, chunk_bytes: int = 512 << 20) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions. logits (B, S, V); target (B, S).

    Computed in float32 (a bf16 log-softmax over a 152K vocabulary loses digits; float64
    logits stay float64), a chunk of rows at a time: float32 temporaries of about
    ``chunk_bytes`` exist at once, only the logits and one float32 log-sum-exp per row
    are kept for backward, and backward writes the gradient straight into one tensor of
    the logits' dtype. The whole-tensor form, ``F.cross_entropy(logits.float(), ...)``,
    keeps a float32 log-softmax of every row (twice the bf16 logits) and makes three
    more full-size tensors in backward. By arithmetic, at 16K tokens x 152,064 vocab
    (bf16 logits 5.0 GB): ~40 GB at the peak of that form, ~11 GB here.
    tests/test_loss.py checks the values and gradients against it and the bytes each
    form saves for backward.
    """
    rows = max(1, chunk_bytes // (4 * logits.shape[-1]))  # float32 bytes per row of the chunk
    return _ChunkedCrossEntropy.apply(logits.flatten(0, 1), target.flatten(), rows)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows with target != IGNORE of logsumexp(x) - x[target], by chunks of rows."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        # logits (N, V) any float dtype; target (N,) long
        n = logits.shape[0]
        acc = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
        lse = torch.empty(n, dtype=acc, device=logits.device)  # (N,)
        total = torch.zeros((), dtype=acc, device=logits.device)
        for start in range(0, n, rows):
            x = logits[start:start + rows].to(acc)  # (C, V)
            t = target[start:start + rows]
            keep = t != IGNORE
            lse[start:start + rows] = row_lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
            total += torch.where(keep, row_lse - picked, 0.0).sum()
        ctx.save_for_backward(logits, target, lse)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        out = torch.empty_like(logits)  # (N, V) in the logits' dtype
        for start in range(0, logits.shape[0], ctx.rows):
            x = logits[start:start + ctx.rows].to(lse.dtype)
            t = target[start:start + ctx.rows]
            keep = (t != IGNORE).to(lse.dtype)  # (C,)
            g = torch.exp(x - lse[start:start + ctx.rows, None])  # softmax (C, V)
            g.scatter_add_(1, t.clamp(min=0)[:, None], -keep[:, None])  # minus the one-hot target
            g *= (grad * keep)[:, None]  # ignored rows: zero
            out[start:start + ctx.rows] = g
        return out, None, None


def label_count(target: torch.Tensor) -> torch.Tensor:
    return (target != IGNORE).sum()
