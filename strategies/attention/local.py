"""Attention over one rank's whole sequence through a weft block kernel (no sequence parallelism).

The same kernels as the ring's blocks (``block_kernels``), called once on the diagonal:
this is how a one-GPU run gets flash-attn-4, which transformers' own ``sdpa`` cannot
call. No float32 accumulators and no merges: the kernel's out and LSE are the result,
and its backward reads them directly.
"""

from __future__ import annotations

import math

import torch

from weft.strategies.attention.kernels.blocks import BlockKernel, expand_kv_heads, select_kernel


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)  # (B, H, S, D), (B, H, S)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, kernel = ctx.config
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        return dq, dk, dv, None, None, None


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    kernel: BlockKernel | None = None,
) -> torch.Tensor:
    """q: (B, H, S, D); k, v: (B, KV, S, D), H % KV == 0. Returns (B, H, S, D) in q's dtype.

    ``kernel`` overrides ``backend`` (tests hand one in); otherwise ``select_kernel``
    picks it from the tensors' device, dtype and head_dim.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    kernel = kernel or select_kernel(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not kernel.gqa:
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
    if not kernel.strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _LocalAttention.apply(q, k, v, causal, scale, kernel)
