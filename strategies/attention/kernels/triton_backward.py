"""Attention block backward that adds into float32 accumulators (Triton, CUDA).

Why it exists: a ring's K/V chunk receives one gradient contribution per ring
step. torch's fused kernels (cuDNN, flash) return each contribution rounded to
bf16, so a chunk's dK/dV carries W roundings before the float32 sum, and at
ring size 2 that exceeds torch's context-parallel tolerance against one
whole-sequence SDPA call (BENCHMARKS.md). These kernels keep every
contribution in float32: each program loads the accumulator tile, adds its
float32 result and stores it back, so a ring's dQ/dK/dV are rounded once, at
the very end, like a single SDPA call's.

Numerics follow the flash-attention backward that torch's SDPA ops use:
scores and dP in float32; P and dS rounded to the input dtype for the
tensor-core matmuls; dK, dV, dQ accumulated in float32. With the final
(merged) out and lse of each row, P = exp(S - lse) is the true softmax, which
is what makes per-block results exact.

Two kernels: one program per (K/V tile, batch, KV head) sweeps the query tiles
of every query head of its group (GQA needs no expanded K/V and no atomics);
one program per (query tile, batch, head) sweeps the K/V tiles for dQ.
``causal`` means the block is square and lies on the diagonal; packed documents
pass their block's boolean mask instead.

Written for this project rather than taken from the flash-attn package: that
package is an optional extra (not installable here) and its backward also
returns dK/dV in the input dtype.
"""

from __future__ import annotations

import functools

import torch

_LOG2E = 1.4426950408889634


@functools.cache
def _kernels():
    import triton  # optional: present with torch's CUDA builds
    import triton.language as tl

    @triton.jit
    def dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, MASK,
        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
        slb, slh, smb, smq, smk, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
        kv_heads, groups, seq_q, seq_k, head_dim, qk_scale2, scale,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    ):
        tile_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // kv_heads
        kvh = bh % kv_heads
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # key rows of this program
        offs_d = tl.arange(0, D)
        n_ok = offs_n < seq_k
        d_ok = offs_d < head_dim
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K + b * skb + kvh * skh + offs_n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0
        )  # (N, D)
        v = tl.load(V + b * svb + kvh * svh + offs_n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
        # Under the diagonal mask query i sees key j only when i >= j: earlier query tiles are skipped.
        start_m = (tile_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
        for g in range(0, groups):
            h = kvh * groups + g
            q_base = Q + b * sqb + h * sqh
            do_base = DO + b * sob + h * soh
            l_base = LSE + b * slb + h * slh
            dl_base = DELTA + b * slb + h * slh
            for start in range(start_m, seq_q, BLOCK_M):
                offs_m = start + tl.arange(0, BLOCK_M)
                m_ok = offs_m < seq_q
                q_mask = m_ok[:, None] & d_ok[None, :]
                q = tl.load(q_base + offs_m[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)  # (M, D)
                do = tl.load(do_base + offs_m[:, None] * sos + offs_d[None, :], mask=q_mask, other=0.0)
                lse2 = tl.load(l_base + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634  # (M,)
                delta = tl.load(dl_base + offs_m, mask=m_ok, other=0.0)
                st = tl.dot(k, tl.trans(q))  # (N, M) scores, transposed
                pt = tl.exp2(st * qk_scale2 - lse2[None, :])
                keep = m_ok[None, :] & n_ok[:, None]
                if CAUSAL:
                    keep = keep & (offs_m[None, :] >= offs_n[:, None])
                if MASKED:
                    allowed = tl.load(
                        MASK + b * smb + offs_m[None, :] * smq + offs_n[:, None] * smk, mask=keep, other=0
                    )
                    keep = keep & (allowed != 0)
                pt = tl.where(keep, pt, 0.0)
                dv += tl.dot(pt.to(do.dtype), do)
                dpt = tl.dot(v, tl.trans(do))  # (N, M)
                dst = pt * (dpt - delta[None, :])
                dk += tl.dot(dst.to(q.dtype), q)
        dk_ptr = DK + b * sdkb + kvh * sdkh + offs_n[:, None] * sdks + offs_d[None, :]
        dv_ptr = DV + b * sdvb + kvh * sdvh + offs_n[:, None] * sdvs + offs_d[None, :]
        tl.store(dk_ptr, tl.load(dk_ptr, mask=kv_mask, other=0.0) + dk * scale, mask=kv_mask)
        tl.store(dv_ptr, tl.load(dv_ptr, mask=kv_mask, other=0.0) + dv, mask=kv_mask)

    @triton.jit
    def dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, MASK,
        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
        slb, slh, smb, smq, smk, sdqb, sdqh, sdqs,
        heads, groups, seq_q, seq_k, head_dim, qk_scale2, scale,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    ):
        tile_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        kvh = h // groups
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        m_ok = offs_m < seq_q
        d_ok = offs_d < head_dim
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)  # (M, D)
        do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], mask=q_mask, other=0.0)
        lse2 = tl.load(LSE + b * slb + h * slh + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + b * slb + h * slh + offs_m, mask=m_ok, other=0.0)
        dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        end_n = tl.minimum(seq_k, (tile_m + 1) * BLOCK_M) if CAUSAL else seq_k
        k_base = K + b * skb + kvh * skh
        v_base = V + b * svb + kvh * svh
        for start in range(0, end_n, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < seq_k
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)  # (N, D)
            v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k))  # (M, N)
            p = tl.exp2(s * qk_scale2 - lse2[:, None])
            keep = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            if MASKED:
                allowed = tl.load(MASK + b * smb + offs_m[:, None] * smq + offs_n[None, :] * smk, mask=keep, other=0)
                keep = keep & (allowed != 0)
            p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        dq_ptr = DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :]
        tl.store(dq_ptr, tl.load(dq_ptr, mask=q_mask, other=0.0) + dq * scale, mask=q_mask)

    return triton, dkdv_kernel, dq_kernel


#: Tiles, warps and pipeline stages: the fastest of a sweep (64/128 tiles, 4/8 warps,
#: 2/3 stages) on one H200 at 16K x 16K, 28 query / 4 KV heads, head_dim 128, causal
#: and not, then a second sweep of narrower inner tiles (BENCHMARKS.md). Adding dQ
#: from the K/V-tile kernel with float32 atomics instead of the second kernel measured
#: no faster. Fixed rather than autotuned: the kernels add into their outputs, so an
#: autotuner's repeated trial runs would corrupt the accumulators.
_CONFIG = {
    "dkdv": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    "dq": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
}


def _rows(x: torch.Tensor) -> torch.Tensor:
    # The kernels index (B, H, S) with strides but need unit stride along head_dim.
    return x if x.stride(-1) == 1 else x.contiguous()


def backward_accumulate(
    dout, q, k, v, out, lse, *, causal: bool, scale: float, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    mask: torch.Tensor | None = None, config: dict | None = None,
) -> None:
    """Add one block's gradients into float32 ``dq`` (B, H, Sq, D) and ``dk``/``dv`` (B, KV, Sk, D).

    q, dout, out: (B, H, Sq, D); k, v: (B, KV, Sk, D) with H a multiple of KV;
    lse: (B, H, Sq) float32, natural log, of the whole row (every block merged).
    ``mask``: (B, 1, Sq, Sk) bool, True = may attend (packed documents); it replaces
    ``causal``. The mask holds one byte per pair, read tile by tile beside Q and dO.
    """
    triton, dkdv_kernel, dq_kernel = _kernels()
    config = {**_CONFIG, **(config or {})}
    q, k, v, dout = (_rows(t) for t in (q, k, v, dout))
    b, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if causal and seq_q != seq_k:
        raise ValueError(f"a causal block must be square; got {seq_q} queries x {seq_k} keys")
    groups = heads // kv_heads
    for name, acc in (("dq", dq), ("dk", dk), ("dv", dv)):
        if acc.dtype != torch.float32 or acc.stride(-1) != 1:
            raise ValueError(
                f"{name} must be a float32 buffer with unit stride along head_dim, "
                f"got {acc.dtype} strides {acc.stride()}"
            )
    if mask is not None:
        causal = False
        allowed = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # (B, 1, Sq, Sk)
        mask_strides = (allowed.stride(0), allowed.stride(2), allowed.stride(3))
    else:
        allowed, mask_strides = q, (0, 0, 0)  # any pointer: never read when MASKED is off
    lse = lse.float().contiguous()  # (B, H, Sq)
    delta = (dout.float() * out.float()).sum(dim=-1).contiguous()  # (B, H, Sq): rowsum(dO * O)
    width = max(16, triton.next_power_of_2(head_dim))
    qk_scale2 = scale * _LOG2E  # exp(x) = exp2(x * log2(e))
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
              lse.stride(0), lse.stride(1), *mask_strides)
    c = config["dkdv"]
    dkdv_kernel[(triton.cdiv(seq_k, c["BLOCK_N"]), b * kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, allowed, *common,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        kv_heads, groups, seq_q, seq_k, head_dim, qk_scale2, scale,
        CAUSAL=causal, MASKED=mask is not None, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], D=width,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    c = config["dq"]
    dq_kernel[(triton.cdiv(seq_q, c["BLOCK_M"]), b * heads)](
        q, k, v, dout, lse, delta, dq, allowed, *common,
        dq.stride(0), dq.stride(1), dq.stride(2),
        heads, groups, seq_q, seq_k, head_dim, qk_scale2, scale,
        CAUSAL=causal, MASKED=mask is not None, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], D=width,
        num_warps=c["num_warps"], num_stages=c["num_stages"],

    )
