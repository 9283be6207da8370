"""Decoding over a key/value cache split across ranks: each rank attends over its shard,
the partial results merge by log-sum-exp.

After a sequence-parallel prefill every rank holds the keys and values of its own part
of the prompt (ring: its zigzag chunks; Ulysses: its contiguous part, all heads). A new
token's query is the same on every rank; each rank computes softmax attention over its
shard alone, with the log-sum-exp of its scores, and the W partial results combine
exactly as the ring's blocks do:

    out = sum_r exp(lse_r - lse) out_r,   lse = log sum_r exp(lse_r)

All cached positions precede the query, so no mask is needed. A rank whose shard is
empty contributes lse = -inf (weight 0). Arithmetic in float32 whatever the cache dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` (B, Hq, Sq, D) over one shard ``key``/``value`` (B, Hkv, N, D),
    every key visible. Returns (out (B, Hq, Sq, D), lse (B, Hq, Sq)), float32."""
    b, hq, sq, d = query.shape
    if key.shape[2] == 0:
        return (query.new_zeros((b, hq, sq, d), dtype=torch.float32),
                query.new_full((b, hq, sq), float("-inf"), dtype=torch.float32))
    if sq == 1 and hq % key.shape[1] == 0:
        # One new token (decoding): the split-KV attention, which reads a bf16 cache as it is
        # (float32 scores, grouped-query heads as a view) in chunks that fill the GPU, with the
        # same kernels whatever the shard's length (cuDNN planned a graph per new length: the
        # cost of a whole decoded token at 128K, BENCHMARKS.md).
        # On CUDA, the Triton form of it (each key and value read once: the static cache's
        # `auto` kernel too); the plain-torch form elsewhere.
        from weft.strategies.attention.decode_split import CHUNK_ROWS, split_decode_attention
        from weft.strategies.attention.kernels.decode_triton import triton_decode_attention, triton_decode_takes

        if triton_decode_takes(key, value):
            out, lse = triton_decode_attention(query, key, value, lengths=None, scale=scale, return_lse=True)
        else:
            out, lse = split_decode_attention(query, key, value, lengths=None, scale=scale,
                                              splits=max(1, key.shape[2] // CHUNK_ROWS), return_lse=True)
        return out.float(), lse.float()
    groups = hq // key.shape[1]  # grouped-query attention: each KV head serves `groups` query heads
    q = query.float().reshape(b, key.shape[1], groups * sq, d)  # (B, Hkv, G x Sq, D)
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # (B, Hkv, G x Sq, N)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G x Sq)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value.float())  # (B, Hkv, G x Sq, D)
    return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """(W, B, H, S, D) partial outputs and their (W, B, H, S) log-sum-exps -> (B, H, S, D)."""
    lse = torch.logsumexp(lses, dim=0)  # (B, H, S)
    weights = torch.exp(lses - lse.unsqueeze(0)).nan_to_num(0.0)  # a query no rank saw: 0, not NaN
    return (weights.unsqueeze(-1) * outs).sum(dim=0)


def partitioned_decode_attention(query: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], *,
                                 scale: float, group) -> torch.Tensor:
    """Attention of ``query`` over the union of this rank's cache ``parts`` ((key, value)
    pairs, e.g. a vision pool and the text's pages) and every other rank's: each part's
    partial result, merged here by log-sum-exp, then across ``group``. (B, Hq, Sq, D) float32."""
    partials = [partial_attention(query, k, v, scale=scale) for k, v in parts]
    if len(partials) == 1:
        out, lse = partials[0]
    else:
        lses = torch.stack([lse for _, lse in partials])  # (P, B, Hq, Sq)
        out = merge_partials(torch.stack([o for o, _ in partials]), lses)
        lse = torch.logsumexp(lses, dim=0)
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return out
    packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # (B, Hq, Sq, D + 1): one collective
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed.contiguous(), group=group)
    stacked = torch.stack(gathered)  # (W, B, Hq, Sq, D + 1)
    return merge_partials(stacked[..., :-1], stacked[..., -1])


def grown_capacity(needed: int, *, page: int) -> int:
    """Rows a text buffer holds for ``needed`` rows: whole pages, so a buffer that fills grows
    by a page (one copy per ``page`` tokens) instead of by a token (a copy per token)."""
    return max(1, -(-needed // page)) * page


def decode_owner(index: int, world: int) -> int:
    """The rank that keeps the keys and values of the ``index``-th decoded token: round
    robin, so each rank's shard grows by one token in W and stays within one of 1/W."""
    return index % world
