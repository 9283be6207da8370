"""Attention block kernels that return the log-sum-exp, for ring attention's merges.

Every kernel has the same two functions, on SDPA's layout:

    forward(q, k, v, *, causal, scale, mask=None) -> (out (B, H, Sq, D), lse (B, H, Sq) float32+)
    backward(dout, q, k, v, out, lse, *, causal, scale, mask=None) -> (dq, dk, dv)

``mask`` (B, 1, Sq, Sk) bool, True = may attend, replaces ``causal`` for packed
documents; kernels marked ``masks`` take it (a row with no allowed key gets
lse = -inf and out = 0).

``backward`` takes the *final* out and lse of the whole row (after every ring
step merged), which is what makes per-block gradients exact: P = exp(S - lse)
is then the true softmax and D = rowsum(dO * O) the true correction term.
k and v carry as many heads as q unless the kernel is marked ``gqa``; the
caller expands them otherwise. With
``causal`` the block is square and lies on the diagonal.

Backends: ``math`` (any device and dtype; the float64 reference), ``cpu_flash``
(torch's fused CPU op), ``cudnn`` and ``torch_flash`` (torch's CUDA SDPA ops),
``flash`` (the optional ``flash-attn-4`` package: CuTe DSL kernels, native GQA,
LSE out and in; on the H200 12-16% faster than cuDNN, which is the fallback),
``triton`` (cuDNN forward; a Triton backward that adds each block's dQ/dK/dV into
the ring's float32 accumulators, so gradients are rounded to bf16 once, at the
end, instead of once per ring step: see ``triton_backward``).

Kernels with ``accumulate`` add a block's gradients into float32 buffers
themselves: ``accumulate(dout, q, k, v, out, lse, *, causal, scale, dq, dk, dv, mask=None)``.
"""

from __future__ import annotations

import functools
from typing import Callable

import attrs
import torch


@attrs.frozen
class BlockKernel:
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    #: Takes k/v with fewer heads than q (GQA) itself; otherwise the caller expands them.
    gqa: bool = False
    #: Accepts strided (non-contiguous) q/k/v/out views, e.g. slices of the sequence dim.
    strided: bool = False
    #: Takes a boolean ``mask`` (packed documents).
    masks: bool = False
    #: Adds a block's gradients into float32 dq/dk/dv buffers (no per-block rounding).
    accumulate: Callable[..., None] | None = None


def expand_kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, KV, S, D) -> (B, KV * groups, S, D), query head h using KV head h // groups: for
    kernels without native GQA (autograd sums the expanded heads' gradients back)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    # True where attention is allowed; the diagonal block is square (sq == sk).
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _math_scores(q, k, *, causal, scale, mask, acc):
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    elif causal:
        s = s.masked_fill(~_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    return s


def _math_forward(q, k, v, *, causal, scale, mask=None):
    acc = torch.promote_types(q.dtype, torch.float32)
    s = _math_scores(q, k, causal=causal, scale=scale, mask=mask, acc=acc)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq); -inf for a row with no allowed key
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, v.to(acc)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, *, causal, scale, mask=None):
    acc = torch.promote_types(q.dtype, torch.float32)
    q_, k_, v_, do = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    s = _math_scores(q, k, causal=causal, scale=scale, mask=mask, acc=acc)
    p = torch.exp(s - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)  # (B, H, Sq, Sk)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v_.transpose(-1, -2))
    delta = (do * out.to(acc)).sum(dim=-1, keepdim=True)  # (B, H, Sq, 1)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k_) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q_) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cpu_flash_forward(q, k, v, *, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.to(torch.promote_types(lse.dtype, torch.float32))


def _cpu_flash_backward(dout, q, k, v, out, lse, *, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.to(q.dtype if q.dtype == torch.float64 else torch.float32), 0.0, causal, scale=scale
    )


def _bias(mask, dtype):
    # cuDNN takes an additive bias: 0 where allowed, -inf where not.
    return (
        None
        if mask is None
        else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    )


def _cudnn_forward(q, k, v, *, causal, scale, mask=None):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, _bias(mask, q.dtype), True, 0.0, causal and mask is None, False, scale=scale
    )[:2]
    return out, _lse3(lse)


def _cudnn_backward(dout, q, k, v, out, lse, *, causal, scale, mask=None):
    # Without dropout or varlen, the RNG state and cumulative lengths are undefined
    # tensors (None), exactly what the forward returns for them.
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(),
        lse.float().unsqueeze(-1).contiguous(),  # cuDNN keeps (B, H, S, 1)
        None, None, _bias(mask, q.dtype), None, None, q.shape[2], k.shape[2], 0.0, causal and mask is None, scale=scale,
    )


def _flash_forward(q, k, v, *, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, _lse3(lse)


def _flash_backward(dout, q, k, v, out, lse, *, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.float().contiguous(),
        None, None, q.shape[2], k.shape[2], 0.0, causal, None, None, scale=scale,
    )


def _lse3(lse: torch.Tensor) -> torch.Tensor:
    # cuDNN returns (B, H, S, 1); the merges work on (B, H, S).
    return (lse.squeeze(-1) if lse.dim() == 4 else lse).float()


@functools.cache
def fa4_importable() -> bool:
    """True when the optional flash-attn-4 package (``flash_attn.cute``) can be imported."""
    try:
        import flash_attn.cute.interface  # noqa: F401 - optional extra
    except Exception:  # ImportError, or a broken install whose DSL fails to load: not usable
        return False
    return True


#: Head dims flash-attn-4 (4.0.0b36) computes correctly, forward and backward, as checked on
#: Hopper by benchmarks/attention/kernels_check.py. At 80 (Qwen2.5-VL's vision tower) its backward
#: returns wrong gradients (dq errs by ~2 where bf16 errs by ~6e-3): other sizes up to 128
#: are zero-padded to the next one here, which changes no score (q.k over the added zeros
#: is 0; the scale stays the true head_dim's) and no output (v's added columns are 0).
FA4_HEAD_DIMS: tuple[int, ...] = (32, 64, 128)


def fa4_head_dim(head_dim: int) -> int:
    """The head dim flash-attn-4 is called with: ``head_dim`` padded to a checked size."""
    return next(d for d in FA4_HEAD_DIMS if d >= head_dim)


def pad_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the last (head) dim to ``width``; no copy when it has that width already."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def fa4_runs_on(device: torch.device, *, head_dim: int) -> bool:
    """flash-attn-4 has kernels for Hopper (sm90) and Blackwell (sm100+); weft calls it for head
    dims up to 128 (padded to a checked size, ``FA4_HEAD_DIMS``); anything else stays on cuDNN."""
    if device.type != "cuda" or head_dim > FA4_HEAD_DIMS[-1] or not fa4_importable():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 9


def _fa4_forward(q, k, v, *, causal, scale):
    from weft.strategies.attention.kernels.flash_ops import fa4_forward

    # flash-attn-4 works on (B, S, H, D); transformers' q/k/v are (B, H, S, D) views of
    # (B, S, H, D) memory, so the transposes are free (the kernel takes strided tensors).
    d, width = q.shape[-1], fa4_head_dim(q.shape[-1])
    t = lambda x: pad_heads(x, width).transpose(1, 2)  # noqa: E731
    out, lse = fa4_forward(t(q), t(k), t(v), causal, scale)
    return out[..., :d].transpose(1, 2), lse  # (B, H, S, D) view, (B, H, S) float32


def _fa4_backward(dout, q, k, v, out, lse, *, causal, scale):
    from weft.strategies.attention.kernels.flash_ops import fa4_backward

    d, width = q.shape[-1], fa4_head_dim(q.shape[-1])
    t = lambda x: pad_heads(x, width).transpose(1, 2)  # noqa: E731
    lse = lse.to(torch.promote_types(lse.dtype, torch.float32)).contiguous()  # the kernel reads float32 (B, H, S)
    dq, dk, dv = fa4_backward(t(dout), t(q), t(k), t(v), t(out), lse, causal, scale)
    return tuple(g[..., :d].transpose(1, 2) for g in (dq, dk, dv))


def _triton_forward(q, k, v, *, causal, scale, mask=None):
    # The forward's per-block outputs are merged in float32 already; only the backward differs.
    if q.shape[-1] <= 128:
        return _cudnn_forward(q, k, v, causal=causal, scale=scale, mask=mask)
    if mask is not None:
        raise ValueError(
            f"attention backend 'triton' takes document masks up to head_dim 128 (cuDNN forward), got {q.shape[-1]}"
        )
    return _flash_forward(q, k, v, causal=causal, scale=scale)


def _triton_accumulate(dout, q, k, v, out, lse, *, causal, scale, dq, dk, dv, mask=None):
    from weft.strategies.attention.kernels.triton_backward import backward_accumulate

    backward_accumulate(dout, q, k, v, out, lse, causal=causal, scale=scale, dq=dq, dk=dk, dv=dv, mask=mask)


def _triton_backward(dout, q, k, v, out, lse, *, causal, scale, mask=None):
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    _triton_accumulate(dout, q, k, v, out, lse, causal=causal, scale=scale, dq=dq, dk=dk, dv=dv, mask=mask)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


KERNELS: dict[str, BlockKernel] = {
    "math": BlockKernel("math", _math_forward, _math_backward, masks=True),
    "cpu_flash": BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward),
    "cudnn": BlockKernel("cudnn", _cudnn_forward, _cudnn_backward, gqa=True, strided=True, masks=True),
    "torch_flash": BlockKernel("torch_flash", _flash_forward, _flash_backward, gqa=True, strided=True),
    "flash": BlockKernel("flash", _fa4_forward, _fa4_backward, gqa=True, strided=True),
    "triton": BlockKernel(
        "triton", _triton_forward, _triton_backward, gqa=True, strided=True, masks=True, accumulate=_triton_accumulate
    ),
}
#: Kernels that run only on CUDA with bf16/fp16 inputs.
_CUDA_HALF = ("cudnn", "torch_flash", "flash", "triton")
BACKENDS: tuple[str, ...] = ("auto", *KERNELS)


def select_kernel(
    backend: str, *, device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool = False
) -> BlockKernel:
    """``auto``: on CUDA for bf16/fp16, flash-attn-4 where it is installed and has kernels
    for the GPU and head_dim (the fastest measured on Hopper), else cuDNN (head_dim <= 128),
    else torch's flash op; torch's fused CPU op on CPU; the math kernel for float64 on CUDA.
    With ``masked`` (packed documents) only kernels that take a mask: cuDNN on CUDA, math
    elsewhere."""
    if backend != "auto":
        if backend not in KERNELS:
            raise ValueError(f"unknown attention backend {backend!r}; accepted: {', '.join(BACKENDS)}")
        if backend in _CUDA_HALF and (device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16)):
            raise ValueError(f"attention backend {backend!r} runs on CUDA with bf16/fp16 inputs, "
                             f"got {device.type} {dtype}; use auto, math or cpu_flash here")
        if masked and not KERNELS[backend].masks:
            raise ValueError(f"attention backend {backend!r} takes no document mask; packed sequences need one of "
                             + ", ".join(k.name for k in KERNELS.values() if k.masks) + " or auto")
        if backend == "flash" and not fa4_importable():
            raise ValueError("attention backend 'flash' needs the flash-attn-4 package "
                             "(pip install 'weft[flash]'); auto falls back to cuDNN without it")
        return KERNELS[backend]
    if masked:
        return (
            KERNELS["cudnn"] if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else KERNELS["math"]
        )
    if device.type == "cuda":
        if dtype in (torch.bfloat16, torch.float16):
            if fa4_runs_on(device, head_dim=head_dim):
                return KERNELS["flash"]
            return KERNELS["cudnn"] if head_dim <= 128 else KERNELS["torch_flash"]
        return KERNELS["math"]
    return KERNELS["cpu_flash"]
