"""Attention of a prompt's later chunk over the chunks before it and itself (chunked prefill).

A prompt prefilled in chunks writes each chunk's keys and values into the cache after the
ones before it; the chunk's queries then attend to every earlier row and, causally, to their
own chunk. That is two blocks of ring attention's kind, merged by log-sum-exp: the prefix,
all of it visible (non-causal, as many keys as the prompt so far), and the chunk's own square
diagonal (causal). The block kernels are the ring's (kernels/blocks.py: flash-attn-4 or
cuDNN on CUDA, torch's fused CPU kernel on the CPU), so no mask of the chunk's rows against
the whole prompt is ever made.
"""

from __future__ import annotations

import torch

from weft.strategies.attention.kernels.blocks import expand_kv_heads, select_kernel
from weft.strategies.attention.ring import merge_block


def prefix_chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, start: int,
                           scale: float, backend: str = "auto") -> torch.Tensor:
    """query (B, Hq, C, D): the chunk's; key/value (B, Hkv, start + C, D): the prompt's rows
    before the chunk, then the chunk's own. Returns (B, Hq, C, D) in the query's dtype."""
    chunk = query.shape[2]
    if key.shape[2] != start + chunk:
        raise ValueError(f"the chunk's keys hold {key.shape[2]} rows, expected {start} before it and its {chunk}")
    kernel = select_kernel(backend, device=query.device, dtype=query.dtype, head_dim=query.shape[-1])
    groups = query.shape[1] // key.shape[1]
    if not kernel.gqa:  # a kernel without GQA takes as many key heads as query heads
        key, value = expand_kv_heads(key, groups), expand_kv_heads(value, groups)

    def block(k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not kernel.strided:  # the cache's rows are views along the sequence
            k, v = k.contiguous(), v.contiguous()
        return kernel.forward(query, k, v, causal=causal, scale=scale)

    out, lse = block(key[:, :, start:], value[:, :, start:], causal=True)  # the chunk's own diagonal
    if start == 0:
        return out
    acc = torch.promote_types(query.dtype, torch.float32)  # the merge accumulates in float32 (float64 stays)
    out, lse = out.to(acc), lse.to(acc)  # (B, Hq, C, D), (B, Hq, C)
    prefix_out, prefix_lse = block(key[:, :, :start], value[:, :, :start], causal=False)
    merge_block(out, lse, prefix_out, prefix_lse)
    return out.to(query.dtype)
