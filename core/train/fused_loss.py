"""Next-token loss straight from the hidden states: lm_head and cross-entropy fused by chunks of rows.

At 128K tokens x 152,064 vocabulary even bf16 logits are 37 GiB, so they never exist
here: forward computes one chunk of logits at a time and keeps one log-sum-exp per row;
backward recomputes each chunk's logits and writes that chunk's share of every gradient.
Same conventions as weft.core.train.loss.token_loss_sum (a sum over labelled positions, the
caller divides by the global label count). It lives in core/ beside that loss: the loss is
part of the loop's contract (sum of token losses / global label count), not a strategy.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from weft.core.train.loss import IGNORE, chunk_backward, chunk_forward, chunk_kernel  # IGNORE: transformers' index


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    chunk_bytes: int = 256 << 20,
    weight_grad_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Sum over labelled rows of cross-entropy(hidden @ weight.T + bias, target), never holding the logits.

    hidden (N, H) or (B, S, H), any float dtype; weight (V, H), the lm_head weight, of
    hidden's dtype or float32; bias (V,) or None; target (N,) or (B, S), IGNORE where unlabelled.
    Returns a float32 scalar (float64 for float64 inputs), the value of
    ``F.cross_entropy((hidden @ weight.T + bias).float(), target, ignore_index=-100, reduction="sum")``.

    Logits are the matmul in the inputs' common dtype (the autocast dtype under autocast),
    then upcast: bf16 logits as the model's own lm_head makes them, from bf16 tensor-core
    GEMMs and without a float32 copy of the weight (upcasting only the hidden chunk is not
    enough: a matmul wants both operands in one dtype); on CUDA the GEMM writes float32
    itself (the unrounded product). The softmax is float32. Gradients come back in each
    input's dtype.

    Rows per chunk: ``chunk_rows``, else ``chunk_bytes // (4 * V)`` (float32 bytes of one
    chunk's logits; 882 rows at V = 152,064 and 512 MiB). Temporaries: on CUDA (no bias),
    forward one such float32 chunk and backward 1.5 (the chunk and its 16-bit gradient, each
    made by one compiled pass); elsewhere forward ~2 and backward one (its 16-bit copy for the
    matmuls written into its own storage), plus on CPU a (V, H) slice of at most ``chunk_bytes``.

    grad_weight: summed over the row chunks in float32 (float64 for float64 inputs), rounded
    to the weight's dtype once at the end. For a float32 weight the sum is the gradient
    itself. For a bf16/fp16 weight the float32 sum (4 * V * H bytes, 2.0 GiB for
    Qwen2.5-VL-7B's 152,064 x 3,584 head) is narrowed in place: the 16-bit gradient is
    written, a slice at a time, into the first half of the sum's own storage, so the
    gradient costs no allocation besides the sum (the lm_head's gradient under a plain
    loss is 1.0 GiB; this one holds 2.0 GiB until FSDP reduces it). ``weight_grad_dtype``
    = bf16 instead sums in bf16 in place (no extra memory, what Liger's kernel does, but
    rounded at every chunk: measured on a bf16 2,048 x 64 case against an exact sum,
    relative error 4.5e-3 over 16 chunks, 1.5e-2 over 128, 5.5e-2 over 512, against 2.0e-3
    for the float32 sum at any count).

    The weight must be a plain tensor: under FSDP2 pass the unsharded parameter (inside
    the FSDP unit's forward), not the sharded DTensor.
    """
    if isinstance(weight, DTensor):
        raise TypeError("linear_cross_entropy_sum wants the unsharded lm_head weight, got a DTensor")
    vocab, width = weight.shape
    rows = chunk_rows if chunk_rows is not None else max(1, chunk_bytes // (4 * vocab))
    compute = _compute_dtype(hidden, weight)
    if weight_grad_dtype is None:
        weight_grad_dtype = torch.promote_types(weight.dtype, torch.float32)
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, width), weight, bias, target.reshape(-1), rows, compute, weight_grad_dtype,
        max(1, chunk_bytes // (compute.itemsize * width)),
    )


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul's dtype: the common dtype, or autocast's where autocast would cast
    (it leaves float64 alone), as F.linear under autocast would compute the logits."""
    common = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device.type
    if common != torch.float64 and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return common


def _no_autocast(device: torch.device):
    """Autocast off: the dtypes are chosen up front, and backward (which autograd runs
    without the caller's autocast) must recompute the very same logits as forward."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over rows with target != IGNORE of logsumexp(z) - z[target], z = hidden @ weight.T + bias,
    a chunk of rows at a time. Saved for backward: the inputs and one log-sum-exp per row."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, rows, compute, weight_grad_dtype, vocab_rows):
        # hidden (N, H); weight (V, H); bias (V,) or None; target (N,) long
        n = hidden.shape[0]
        acc = torch.promote_types(compute, torch.float32)  # float32, or float64 for float64 inputs
        lse = torch.empty(n, dtype=acc, device=hidden.device)  # (N,)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        # On CUDA one compiled pass over each chunk (log-sum-exp and the picked logit), where
        # eager torch makes the max, a shifted copy, its exponential and their sum as passes of
        # their own over the float32 chunk (core/train/loss.py's kernels, shared with the chunked loss).
        forward = chunk_kernel(chunk_forward, hidden.device)
        with _no_autocast(hidden.device):
            w, b = _cast(weight, compute), _cast(bias, compute)  # no copy when already `compute`
            for start in range(0, n, rows):
                x = _logits(hidden[start:start + rows], w, b, compute, acc)  # (C, V)
                lse[start:start + rows], part = forward(x, target[start:start + rows], acc)
                total += part  # the labelled rows' sum: a where, not a mask, so no host sync
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.rows, ctx.compute, ctx.weight_grad_dtype, ctx.vocab_rows = rows, compute, weight_grad_dtype, vocab_rows
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        compute, acc, rows = ctx.compute, lse.dtype, ctx.rows
        grad_h = torch.empty_like(hidden) if want_h else None  # (N, H) in hidden's dtype
        grad_w = torch.zeros(weight.shape, dtype=ctx.weight_grad_dtype, device=weight.device) if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if want_b else None
        # On CUDA without a bias, the chunk's gradient in one compiled pass (the float32 logits
        # read once, the matmuls' dtype written once: 1.5 chunks at once); else in place in the
        # logits' own storage, one pass an operation (1 chunk; the bias's sum wants float32).
        fused = chunk_kernel(chunk_backward, hidden.device) if hidden.is_cuda and not want_b else None
        with _no_autocast(hidden.device):
            w, b = _cast(weight, compute), _cast(bias, compute)
            for start in range(0, hidden.shape[0], rows):
                h = hidden[start:start + rows].to(compute)  # (C, H)
                t, row_lse = target[start:start + rows], lse[start:start + rows]
                g = _logits(h, w, b, compute, acc)  # (C, V), recomputed: the logits were never kept
                if fused is not None:
                    g = fused(g, t, row_lse, grad, compute)
                else:
                    g = softmax_grad_in_place(g, t, row_lse, grad, compute, grad_b=grad_b)
                if want_h:
                    grad_h[start:start + rows] = g @ w  # (C, H)
                if want_w:
                    _add_weight_grad(grad_w, g, h, ctx.vocab_rows)
        if want_w:  # one rounding, after the sum over all chunks
            grad_w = _narrow(grad_w, weight.dtype, ctx.vocab_rows) if grad_w.dtype != weight.dtype else grad_w
        if want_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def softmax_grad_in_place(g: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                          compute: torch.dtype, *, grad_b: torch.Tensor | None = None) -> torch.Tensor:
    """core/train/loss.py's ``chunk_backward(g, t, lse, grad, compute)`` with no temporary: g (C, V),
    the chunk's logits in float32 (float64), becomes their gradient in ``compute``, written into
    g's own storage; ``grad_b`` (V,) gains the rows' sum before the narrowing."""
    keep = (t != IGNORE).to(g.dtype)  # (C,)
    g.sub_(lse[:, None]).exp_()  # softmax, in place
    g.scatter_add_(1, t.clamp(min=0)[:, None], -keep[:, None])  # minus the one-hot target
    g.mul_((grad * keep)[:, None])  # ignored rows: zero
    if grad_b is not None:
        grad_b += g.sum(0)
    # The matmuls run in the logits' dtype, as autograd through F.linear would; a narrower
    # dtype is written into g's own storage (no second chunk-sized buffer).
    return _narrow(g, compute, max(1, g.shape[0] // 8)) if g.dtype != compute else g


def _narrow(wide: torch.Tensor, dtype: torch.dtype, vocab_rows: int) -> torch.Tensor:
    """``wide.to(dtype)`` for a contiguous 2-D tensor (the (V, H) sum, a (C, V) chunk) and a
    dtype of half its width, written into the first half of ``wide``'s own storage,
    ``vocab_rows`` rows at a time: no second allocation of its size. Slice i's 16-bit values
    land on bytes [2is, 2is + 2s) of the storage, which hold wide elements of slices before
    i, already converted (s = the slice's element count); slice 0 overlaps itself and goes
    through a copy."""
    if wide.element_size() != 2 * torch.empty((), dtype=dtype).element_size() or not wide.is_contiguous():
        return wide.to(dtype)
    flat = wide.view(-1)  # (V * H,) wide
    narrow = flat.view(dtype)  # (2 * V * H,) the same bytes, read as the narrow dtype
    step = max(1, vocab_rows) * wide.shape[1]
    for start in range(0, flat.numel(), step):
        end = min(flat.numel(), start + step)
        source = flat[start:end]
        narrow[start:end].copy_(source.clone() if end > 2 * start else source)  # bytes overlap: slice 0
    return narrow[: flat.numel()].view(wide.shape)


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


def _logits(h, w, b, compute, acc) -> torch.Tensor:
    """(C, V) logits in ``acc``: the matmul (plus bias, F.linear's one rounding) in ``compute``, then upcast.

    On CUDA, 16-bit operands without a bias: cuBLAS writes the float32 product directly
    (``out_dtype``), with no 16-bit chunk to round into and upcast (a chunk-sized
    temporary and an element-wise pass fewer; the logits are then the unrounded product)."""
    h = h.to(compute)
    if h.is_cuda and b is None and compute in (torch.bfloat16, torch.float16) and acc == torch.float32:
        return torch.mm(h, w.T, out_dtype=torch.float32)
    z = h @ w.T if b is None else torch.addmm(b, h, w.T)  # (C, V) in `compute`
    return z.to(acc)


def _add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor, vocab_rows: int) -> None:
    """grad_w += g.T @ h; g (C, V), h (C, H), both in the compute dtype.

    Same dtype, or 16-bit operands into a float32 sum on CUDA: one GEMM into the sum (beta = 1).
    Otherwise (a wider sum elsewhere): the product is made in the compute dtype, a slice of at
    most ``vocab_rows`` vocabulary rows at a time, so the temporary stays chunk-sized rather
    than (V, H) (1.1 GB in bf16).
    """
    if grad_w.dtype == g.dtype:
        grad_w.addmm_(g.T, h)
        return
    if grad_w.is_cuda and g.dtype in (torch.bfloat16, torch.float16) and grad_w.dtype == torch.float32:
        # cuBLAS multiplies 16-bit operands into the float32 sum itself (beta = 1): no product
        # temporary, one pass over the sum per chunk instead of a product written and then added.
        torch.addmm(grad_w, g.T, h, out_dtype=torch.float32, out=grad_w)
        return
    for v in range(0, grad_w.shape[0], vocab_rows):
        grad_w[v:v + vocab_rows] += g[:, v:v + vocab_rows].T @ h  # (Vs, H)
