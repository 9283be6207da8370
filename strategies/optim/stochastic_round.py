"""Stochastic rounding of float32 to bfloat16, and the AdamW element step that uses it.

Why: a bf16 weight has 8 significant bits, so round-to-nearest returns the weight
unchanged for any update smaller than half its bf16 spacing (2^-9 of its magnitude).
At fine-tuning learning rates (1e-5) that is most updates: 5 AdamW steps on
N(0, 0.02) weights change 14.9% of them (BENCHMARKS.md). Rounding up or down at random,
with the probability of each in proportion to the remainder, keeps every update on
average: E[round(x)] = x.

How: a float32 with its low 16 bits cleared is exactly a bf16. Adding a uniform random
integer in [0, 2^16) to the float32's bit pattern, then clearing those bits, carries
into the kept bits with probability remainder / spacing — the sign is in the top bit,
so the magnitude is rounded and the value's expectation is unchanged on either side
of zero.

This file is the reference in plain torch (any device, any generator); the CUDA path
is strategies/optim/stochastic_round_triton.py, the same arithmetic in one fused kernel.
"""

from __future__ import annotations

import torch

#: Elements per chunk of the torch path: bounds its float32 temporaries (~5 x 16 MiB).
CHUNK = 1 << 22


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, *, generator: torch.Generator | None) -> None:
    """Write float32 ``x`` into bf16 ``out``, rounded at random (unbiased); ``x`` is overwritten."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits.add_(noise).bitwise_and_(-(1 << 16))  # -65536 = 0xFFFF0000: keep sign, exponent, 7 mantissa bits
    out.copy_(x)  # exact: the dropped bits are zero


def store_(out: torch.Tensor, x: torch.Tensor, *, generator: torch.Generator | None) -> None:
    """``out = x``: stochastically rounded for a bf16 ``out``, plainly for a float32 one."""
    if out.dtype == torch.bfloat16:
        stochastic_round_(out, x, generator=generator)
    else:
        out.copy_(x)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                seed: int) -> None:
    """One AdamW step of one tensor in float32, stored back in each tensor's own dtype.

    The arithmetic of torch's AdamW (decoupled weight decay, bias corrections, eps added
    after the corrected square root), done in float32 whatever the storage; bf16 results
    (weights and, when kept in bf16, the moments) are rounded stochastically from
    generators seeded by ``seed``, so a step repeats exactly from the same seed.
    Tensors must be contiguous (FSDP2's local shards and plain parameters are).
    """
    bias1 = 1 - beta1 ** step
    bias2_sqrt = (1 - beta2 ** step) ** 0.5
    generator = torch.Generator(device=param.device)
    generator.manual_seed(seed)
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    for start in range(0, flat[0].numel(), CHUNK):
        p, g, m, v = (t[start:start + CHUNK] for t in flat)
        g32 = g.float()
        m32 = m.float().mul_(beta1).add_(g32, alpha=1 - beta1)
        v32 = v.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        p32 = p.float().mul_(1 - lr * weight_decay)
        denom = v32.sqrt().div_(bias2_sqrt).add_(eps)
        p32.addcdiv_(m32, denom, value=-lr / bias1)
        store_(m, m32, generator=generator)
        store_(v, v32, generator=generator)
        store_(p, p32, generator=generator)


def below_half_step(weight: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Where round-to-nearest in bf16 would lose ``update`` to ``weight`` (a bool tensor).

    A weight w with |w| in [2^(e-1), 2^e) has bf16 spacing 2^(e-8); an update under half
    of it rounds back to w. A zero weight keeps any update (bf16 reaches far below).
    """
    _, exponent = torch.frexp(weight.float())
    half = torch.ldexp(torch.ones_like(weight, dtype=torch.float32), exponent - 9)
    return (update.float().abs() < half) & (weight != 0)
