"""The AdamW step with stochastic rounding as one Triton kernel per tensor (CUDA).

Why a kernel of our own: torchao's ``_AdamW(bf16_stochastic_round=True)`` compiles one
step per parameter shape and materialises float32 copies of each tensor; on one H200 it
took 3.04 s for 8.3B parameters and ran both 7B recipes out of memory (BENCHMARKS.md). Here
each program loads a block of weights, gradients and moments, does the float32 math of
strategies/optim/stochastic_round.py in registers and stores the rounded results: no
temporaries, one read and one write of each byte — the step is bound by memory
bandwidth, like torch's fused AdamW.

The random bits come from Triton's Philox generator, keyed by (seed, element index):
a step repeats exactly from its seed, whatever the block size or launch grid.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 2048


@functools.cache
def _kernel():
    import triton  # optional: present with torch's CUDA builds
    import triton.language as tl

    @triton.jit
    def adamw_sr_kernel(P, G, M, V, n, seed, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt,
                        ROUND_P: tl.constexpr, ROUND_M: tl.constexpr, ROUND_V: tl.constexpr,
                        STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        p = tl.load(P + offs, mask=ok).to(tl.float32)
        g = tl.load(G + offs, mask=ok).to(tl.float32)
        m = tl.load(M + offs, mask=ok).to(tl.float32)
        v = tl.load(V + offs, mask=ok).to(tl.float32)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p * decay
        p = p - step_size * (m / (tl.sqrt(v) / bias2_sqrt + eps))
        if STOCHASTIC:
            # Add 16 random bits below bf16's mantissa, then drop them (stochastic_round.py says why);
            # written out three times: Triton's interpreter finds no helper defined in this closure.
            r0, r1, r2, _ = tl.randint4x(seed, offs.to(tl.int32))
            if ROUND_P:
                p = ((p.to(tl.int32, bitcast=True) + (r0 & 0xFFFF).to(tl.int32)) & -65536).to(tl.float32, bitcast=True)
            if ROUND_M:
                m = ((m.to(tl.int32, bitcast=True) + (r1 & 0xFFFF).to(tl.int32)) & -65536).to(tl.float32, bitcast=True)
            if ROUND_V:
                v = ((v.to(tl.int32, bitcast=True) + (r2 & 0xFFFF).to(tl.int32)) & -65536).to(tl.float32, bitcast=True)
        tl.store(P + offs, p.to(P.dtype.element_ty), mask=ok)
        tl.store(M + offs, m.to(M.dtype.element_ty), mask=ok)
        tl.store(V + offs, v.to(V.dtype.element_ty), mask=ok)

    return adamw_sr_kernel


def available(device: torch.device) -> bool:
    """The kernel runs here: a CUDA device and Triton importable."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, seed: int,
                stochastic: bool = True, to_bf16: tuple[bool, bool, bool] | None = None) -> None:
    """strategies/stochastic_round.adamw_step_ in one kernel launch. ``stochastic=False``
    rounds to nearest; ``to_bf16`` (weight, first, second moment) overrides which results
    are rounded onto the bf16 grid — the tests round float32 storage so, as Triton's CPU
    interpreter has no bf16."""
    n = param.numel()
    if n == 0:
        return
    bf16 = torch.bfloat16
    round_p, round_m, round_v = to_bf16 or (param.dtype == bf16, exp_avg.dtype == bf16, exp_avg_sq.dtype == bf16)
    _kernel()[(triton_cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, n, seed % (1 << 31), lr, beta1, beta2, eps, 1 - lr * weight_decay,
        lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5,
        ROUND_P=round_p, ROUND_M=round_m, ROUND_V=round_v,
        STOCHASTIC=stochastic, BLOCK=BLOCK, num_warps=8)


def triton_cdiv(n: int, block: int) -> int:
    return (n + block - 1) // block
