"""flash-attn-4's forward and backward as torch operators (``torch.library.custom_op``).

Why operators: torch's machinery can name an operator and nothing inside it. Selective
activation checkpointing keeps an operator's outputs by name, so a unit recomputed in the
backward reuses its attention's out and LSE instead of running the kernel again
(``activation_checkpoint``, mode ``except_attention``); the CuTe kernels, called from
Python through TVM's FFI, are invisible to it otherwise. The operators take and return
flash-attn-4's own layout, (B, S, H, D); ``block_kernels`` does the transposes (free views).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("weft::fa4_forward", mutates_args=())
def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, S, H, D); k, v: (B, S, KV, D). Returns out (B, S, H, D) and the LSE (B, H, S),
    float32 for 16-bit inputs."""
    from flash_attn.cute.interface import _flash_attn_fwd  # optional extra: flash-attn-4

    out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    return out, lse.contiguous()


@fa4_forward.register_fake
def _(q, k, v, causal, scale):
    b, s, h, _ = q.shape
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=lse_dtype)


@torch.library.custom_op("weft::fa4_backward", mutates_args=())
def fa4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All (B, S, heads, D) but the LSE (B, H, S) float32. Returns dq, dk, dv in that layout."""
    from flash_attn.cute.interface import _flash_attn_bwd  # optional extra: flash-attn-4

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, scale, causal)[:3]
    return dq, dk, dv


@fa4_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def fa4_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, lengths: torch.Tensor,
               scale: float) -> torch.Tensor:
    """One new token per row through flash-attn-4's split-KV forward: ``query`` (B, Hq, 1, D)
    over a preallocated cache ``key``/``value`` (B, Hkv, N, D), row b seeing its first
    ``lengths[b]`` rows (``seqused_k``, read on the device: no host length, the same kernel at
    every token); the split count is the library's heuristic for the GPU's SMs, grouped-query
    heads packed by it. The cache is handed over as (B, N, Hkv, D) views (its strides are
    16-byte aligned, so nothing is copied). Returns (B, Hq, 1, D)."""
    from flash_attn.cute.interface import _flash_attn_fwd  # optional extra: flash-attn-4

    b = query.shape[0]
    used = lengths.reshape(-1).to(torch.int32).expand(b).contiguous()  # (B,): one for every row broadcasts
    out, *_ = _flash_attn_fwd(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), seqused_k=used,
                              softmax_scale=scale, causal=False, num_splits=0)
    return out.transpose(1, 2)  # (B, Hq, 1, D)
