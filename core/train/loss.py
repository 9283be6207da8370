"""Next-token loss as a sum over label tokens, so the caller divides by the global count.

A micro-batch carries either ``labels`` (aligned with the inputs; shifted here) or,
under sequence parallelism, ``shift_labels``: already shifted on the whole
sequence and then split like the inputs, so each rank's part predicts exactly the
tokens the unsharded model would (the last token of a rank's part predicts the
first token of the next part).
"""

from __future__ import annotations

import functools

import torch

IGNORE = -100

#: Products whose backward never reads their output (a linear layer's logits): only logits
#: made by one of them, through views at most, may give their storage to their gradient.
#: Any other producer (a soft-cap's tanh keeps its output, a cast is a copy) gets a fresh
#: tensor.
_PRODUCTS = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0"})
_VIEWS = frozenset({"UnsafeViewBackward0", "ViewBackward0", "ReshapeAliasBackward0", "AsStridedBackward0",
                    "SliceBackward0"})


def targets(batch: dict) -> torch.Tensor:
    """(B, S_local) targets aligned with the logits' positions."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)  # position t predicts t+1


def token_loss_sum(logits: torch.Tensor, target: torch.Tensor, *, chunk_bytes: int = 512 << 20,
                   reuse_logits: bool = False) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions. logits (B, S, V); target (B, S).

    Computed in float32 (a bf16 log-softmax over a 152K vocabulary loses digits; float64
    logits stay float64), a chunk of rows at a time: float32 temporaries of about
    ``chunk_bytes`` exist at once, only the logits and one float32 log-sum-exp per row
    are kept for backward, and backward writes the gradient straight into one tensor of
    the logits' dtype. The whole-tensor form, ``F.cross_entropy(logits.float(), ...)``,
    keeps a float32 log-softmax of every row (twice the bf16 logits) and makes three
    more full-size tensors in backward. By arithmetic, at 16K tokens x 152,064 vocab
    (bf16 logits 5.0 GB): ~40 GB at the peak of that form, ~11 GB here.

    ``reuse_logits``: the caller holds the logits for nothing but this loss, so backward
    writes their gradient into their own storage (a chunk is read before it is
    overwritten). That is the step's peak at short lengths: the logits and a gradient of
    their size (2 x 9.3 GiB at 32K tokens of a 152K vocabulary) are alive together
    otherwise. Only taken where the logits come straight out of a product, whose
    backward does not read its output (``_PRODUCTS``).

    On CUDA each chunk's forward and backward are compiled (one fused kernel each instead
    of a float32 copy, an exponential, a scatter and a product as separate passes over
    the chunk). tests/test_loss.py checks the values and gradients against torch's form
    and the bytes each form saves for backward.
    """
    rows = max(1, chunk_bytes // (4 * logits.shape[-1]))  # float32 bytes per row of the chunk
    reuse = reuse_logits and _made_by_product(logits)
    return _ChunkedCrossEntropy.apply(logits.flatten(0, 1), target.flatten(), rows, reuse)


def _made_by_product(logits: torch.Tensor) -> bool:
    """Whether autograd reaches a product (``_PRODUCTS``) from the logits through views only."""
    node = logits.grad_fn
    while node is not None and type(node).__name__ in _VIEWS:
        parents = [parent for parent, _ in node.next_functions if parent is not None]
        node = parents[0] if len(parents) == 1 else None
    return node is not None and type(node).__name__ in _PRODUCTS


def chunk_forward(x: torch.Tensor, t: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (C, V) logits, t (C,) targets -> (lse (C,), sum of the labelled rows' losses)."""
    x = x.to(acc)
    lse = torch.logsumexp(x, dim=-1)  # (C,)
    picked = x.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
    return lse, torch.where(t != IGNORE, lse - picked, 0.0).sum()


def chunk_backward(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """d(loss)/d(x) for one chunk, in ``dtype`` (x's by default): (softmax - one-hot target) x grad,
    zero on ignored rows. The fused loss passes float32 logits and asks for the matmuls' dtype."""
    scale = torch.where(t != IGNORE, grad, 0.0).to(lse.dtype)  # (C,)
    g = torch.exp(x.to(lse.dtype) - lse[:, None])  # softmax (C, V)
    if torch.compiler.is_compiling():
        # The one-hot target as the column index compared with it: Inductor fuses it into the
        # one pass (a scatter made the softmax a float32 buffer of its own, written and read
        # again). An ignored row matches no column; its scale is 0 either way.
        g = g - (torch.arange(g.shape[1], device=g.device) == t[:, None]).to(g.dtype)
    else:  # eagerly in place: no chunk-sized temporaries besides g
        g.scatter_add_(1, t.clamp(min=0)[:, None], -torch.ones_like(g[:, :1]))  # minus the one-hot target
    return (g * scale[:, None]).to(dtype or x.dtype)


@functools.cache
def _compiled(fn):
    # One compiled kernel per chunk function for the process (torch's own compile cache
    # holds the graphs either way); automatic dynamic shapes, so the ragged last chunk and
    # new sequence lengths recompile once, not once per length.
    return torch.compile(fn)


def chunk_kernel(fn, device: torch.device):
    """``fn`` compiled on CUDA (one fused pass over a chunk), as written elsewhere."""
    return _compiled(fn) if device.type == "cuda" else fn


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows with target != IGNORE of logsumexp(x) - x[target], by chunks of rows."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, rows: int, reuse: bool) -> torch.Tensor:
        # logits (N, V) any float dtype; target (N,) long
        n = logits.shape[0]
        acc = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
        lse = torch.empty(n, dtype=acc, device=logits.device)  # (N,)
        total = torch.zeros((), dtype=acc, device=logits.device)
        forward = chunk_kernel(chunk_forward, logits.device)
        for start in range(0, n, rows):
            row_lse, part = forward(logits[start:start + rows], target[start:start + rows], acc)
            lse[start:start + rows] = row_lse
            total += part
        ctx.save_for_backward(logits, target, lse)
        ctx.rows, ctx.reuse = rows, reuse
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        # (N, V) in the logits' dtype; with reuse, the logits' own storage: each chunk is
        # read by the kernel before its gradient is written back over it.
        out = logits if ctx.reuse else torch.empty_like(logits)
        backward = chunk_kernel(chunk_backward, logits.device)
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            out[start:stop] = backward(logits[start:stop], target[start:stop], lse[start:stop], grad)
        return out, None, None, None


def label_count(target: torch.Tensor) -> torch.Tensor:
    return (target != IGNORE).sum()
