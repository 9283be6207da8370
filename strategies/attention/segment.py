"""Non-causal attention inside each segment of a packed sequence: the vision tower's windows and images.

A Qwen2.5-VL vision block attends inside windows (64 patches each) or whole images.
transformers' SDPA path loops over them: one SDPA call per window, a split and a cat,
and a host sync per block to learn the lengths. On one 448x448 image that is 16 calls
per block and 32 blocks, several thousand tiny kernels the host cannot launch as fast as
the GPU runs them (measured: the GPU idles ~0.5 s of a 5 s 7B step at 32K tokens in the
tower, BENCHMARKS.md). flash-attn-4's variable-length kernels take all segments in ONE
call from the cumulative lengths, forward and backward, with no host sync; elsewhere
(CPU, float32, other GPUs) the loop over segments stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weft.strategies.attention.kernels.blocks import fa4_head_dim, fa4_runs_on, pad_heads


def segment_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Non-causal attention inside each [cu_seqlens[i], cu_seqlens[i+1]) segment, one SDPA
    call per segment. (B, H, S, D)."""
    bounds = cu_seqlens.tolist()  # host sync: the segments' lengths
    outs = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=scale)
        for a, b in zip(bounds[:-1], bounds[1:])
        if b > a
    ]
    return torch.cat(outs, dim=2)


class _VarlenFA4(torch.autograd.Function):
    """flash-attn-4 over packed segments. q, k, v: (S, H, D); cu_seqlens: (N + 1,) int32."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        from flash_attn.cute.interface import _flash_attn_fwd  # optional extra: flash-attn-4

        out, lse, *_ = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                       max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale,
                                       causal=False, return_lse=True)  # (S, H, D), (H, S) float32
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.config = (max_seqlen, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        from flash_attn.cute.interface import _flash_attn_bwd

        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        max_seqlen, scale = ctx.config
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, False, cu_seqlens_q=cu_seqlens,
                                     cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)[:3]
        return dq, dk, dv, None, None, None


def varlen_runs(q: torch.Tensor) -> bool:
    """Whether the one-call kernel takes these inputs: flash-attn-4 on its GPUs, 16-bit."""
    return q.dtype in (torch.bfloat16, torch.float16) and fa4_runs_on(q.device, head_dim=q.shape[-1])


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor, scale: float,
                      max_seqlen: int | None = None) -> torch.Tensor:
    """q, k, v: (1, H, S, D) (one packed sequence, as transformers' vision attention hands
    them). Returns (1, H, S, D). One flash-attn-4 call where it runs (``max_seqlen``: the
    longest segment, which it needs; computed here with a host sync when not given),
    else one SDPA call per segment."""
    if q.shape[0] != 1 or not varlen_runs(q):
        return segment_loop(q, k, v, cu_seqlens=cu_seqlens, scale=scale)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    # (1, H, S, D) -> (S, H, D'): free for transformers' views, but for the zero-padding of head
    # dims flash-attn-4 is not checked at (80, the tower's: ``fa4_head_dim``), which autograd undoes.
    d, width = q.shape[-1], fa4_head_dim(q.shape[-1])
    flat = lambda x: pad_heads(x[0].transpose(0, 1), width).contiguous()  # noqa: E731
    out = _VarlenFA4.apply(flat(q), flat(k), flat(v), cu_seqlens.to(torch.int32), int(max_seqlen), scale)
    return out[..., :d].transpose(0, 1).unsqueeze(0)  # (1, H, S, D)
