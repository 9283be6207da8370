"""How many bf16 updates round-to-nearest would lose: a sample of each parameter group.

An AdamW step moves a weight by lr * m_hat / (sqrt(v_hat) + eps) + lr * wd * w; under
round-to-nearest a bf16 weight keeps that move only when it is at least half its bf16
spacing. Read from the optimizer's moments (``exp_avg``, ``exp_avg_sq``, ``step``: torch's
AdamW and weft's adamw_sr keep them so) for a strided sample of each tensor's elements:
cheap enough to run every few hundred steps, exact for the sampled elements. Each tensor's
sampled share counts in proportion to its size, so a group's figure is the share of its
elements (a bias of zeros, all of whose updates stay, weighs as little as it holds).
"""

from __future__ import annotations

from typing import Any

import torch

from weft.strategies.optim.adamw_sr import local
from weft.strategies.optim.stochastic_round import below_half_step


def _sample(t: torch.Tensor, per_tensor: int) -> torch.Tensor:
    flat = local(t).reshape(-1)
    return flat[:: max(1, flat.numel() // per_tensor)][:per_tensor]


def lost_fractions(optimizer: Any, *, per_tensor: int = 1024) -> list[tuple[int, float, int]]:
    """(group index, estimated share of the group's bf16 elements whose update is under half a
    bf16 step, elements sampled) for each group holding bf16 weights with Adam moments; the
    update is the one the moments and the group's learning rate give now."""
    found = []
    for index, group in enumerate(optimizer.param_groups):
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        lr, eps, decay = float(group["lr"]), group.get("eps", 1e-8), group.get("weight_decay", 0.0)
        lost, total, sampled = [], 0, 0
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            moments = state.get("exp_avg"), state.get("exp_avg_sq")
            if p.dtype != torch.bfloat16 or not all(type(m) in (torch.Tensor,) or hasattr(m, "to_local")
                                                    for m in moments):
                continue  # float32 weights lose nothing; quantised moments (8-bit) are not read here
            step = float(state["step"])
            w = _sample(p.detach(), per_tensor).float()
            m, v = (_sample(t, per_tensor).float() for t in moments)
            update = lr * (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps) + lr * decay * w
            size = local(p).numel()
            lost.append(below_half_step(w, update).float().mean() * size)  # the sample's share, scaled to the tensor
            total += size
            sampled += w.numel()
        if total:
            found.append((index, float(torch.stack(lost).sum()) / total, sampled))  # one sync per group
    return found
