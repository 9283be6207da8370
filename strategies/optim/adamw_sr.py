"""AdamW that loses no update in bf16: float32 math, stochastic rounding of what is stored.

For float32 parameters it is torch's AdamW itself (the functional ``adam`` with decoupled
weight decay, fused on CUDA, foreach elsewhere): the same numbers as ``torch.optim.AdamW``.
For bf16 parameters each tensor's step runs in float32 and the weight — and the moments,
when kept in bf16 (``state_dtype = "param"``) — are rounded stochastically: with
beta2 = 0.999 the second moment moves by 0.1% a step, under half a bf16 step, so
round-to-nearest would freeze it as it freezes small weight updates.

Randomness: one 62-bit seed per step drawn from torch's CPU generator (no device sync),
mixed with each tensor's index. Every rank draws the same seed (the loop seeds torch
alike on every rank), so replicas round alike and stay equal; a checkpoint saves the
generator, so a resumed run equals one never stopped.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.optim.adam import adam

from weft.strategies.optim import stochastic_round, stochastic_round_triton

#: Mixes a tensor's index into the step's seed (a large odd constant: distinct streams).
_STREAM = 0x9E3779B97F4A7C15


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class AdamWSR(torch.optim.Optimizer):
    """AdamW with stochastic rounding for bf16 tensors; torch's AdamW for float32 ones."""

    #: What weft's update guard reads: bf16 updates are rounded stochastically, not lost.
    bf16_rounding = "stochastic"

    def __init__(self, params: Any, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, state_dtype: Literal["param", "float32"] = "param") -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "state_dtype": state_dtype}
        super().__init__(params, defaults)

    def _state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            dtype = torch.float32 if group["state_dtype"] == "float32" else p.dtype
            # bf16: the step count on the CPU, so reading it needs no sync; float32 on CUDA: on the
            # device, as torch's fused AdamW requires.
            on_device = p.dtype != torch.bfloat16 and p.device.type == "cuda"
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        seed = int(torch.randint(0, 1 << 62, (1,)))
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            exact: list[tuple[torch.Tensor, dict]] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p, group)
                index += 1
                if p.dtype != torch.bfloat16:
                    exact.append((p, state))
                    continue
                state["step"] += 1
                step = int(state["step"])
                tensors = [local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                kernel = (stochastic_round_triton if stochastic_round_triton.available(tensors[0].device)
                          else stochastic_round)
                kernel.adamw_step_(*tensors, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                                   weight_decay=group["weight_decay"], seed=(seed + index * _STREAM) % (1 << 62))
            if exact:
                self._exact(exact, group, lr=lr)
        return loss

    @staticmethod
    def _exact(pairs: list[tuple[torch.Tensor, dict]], group: dict, *, lr: float) -> None:
        """float32 (or other non-bf16) tensors: torch's own AdamW arithmetic, unchanged."""
        params = [p for p, _ in pairs]
        fused = all(p.device.type == "cuda" for p in params)
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for _, s in pairs],
             [s["exp_avg_sq"] for _, s in pairs], [], [s["step"] for _, s in pairs],
             foreach=None if fused else True, fused=True if fused else None, decoupled_weight_decay=True,
             amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=False)
