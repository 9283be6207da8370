"""The run's optimizer and learning-rate schedule, from ``[train]``.

``adamw``: torch's AdamW in the parameters' own dtype (fused on CUDA: a few kernels per
chunk of tensors instead of one per operation; foreach elsewhere).

``adamw_bf16_sr``: torchao's AdamW with bf16 stochastic rounding, for weights stored in
bf16 (shard rule ``storage_dtype = "bfloat16"``): the update is computed in float32 and
rounded to bf16 up or down at random, in proportion to the remainder, so an update
smaller than half a bf16 step (2^-9 of the weight: a 0.02 weight moves by no less than
~4e-5) still moves the weight on average instead of vanishing; torch's AdamW in bf16
rounds it away. Chosen from torchao (a well-kept library of this field) rather than
written here; its per-parameter step is compiled once per parameter shape.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from weft.core.errors import WeftError

OPTIMIZERS = ("adamw", "adamw_bf16_sr")


def torchao_missing() -> str | None:
    """Why torchao's optimizer cannot be used here, or None."""
    try:
        from torchao.optim import _AdamW  # noqa: F401 - optional extra: pip install weft[sr]
    except Exception as error:  # ImportError, or a broken install
        return f"{type(error).__name__}: {error}"
    return None


def make_optimizer(recipe: Any, model: torch.nn.Module) -> tuple[Any, Any]:
    """The optimizer ``train.optimizer`` names and the warmup + cosine schedule of ``[train]``."""
    train = recipe.train
    params = [p for p in model.parameters() if p.requires_grad]  # frozen units (trainable = false): no state
    common = {"betas": (train.beta1, train.beta2), "weight_decay": train.weight_decay}
    if train.optimizer == "adamw_bf16_sr":
        missing = torchao_missing()
        if missing is not None:
            raise WeftError(f"train.optimizer = 'adamw_bf16_sr' needs torchao (pip install 'weft[sr]'): {missing}",
                            where="train.optimizer")
        # torchao keeps lr as a tensor (its step is compiled); the schedule fills it in place.
        optimizer = _reproducible_sr_adamw()(params, lr=torch.tensor(train.lr), bf16_stochastic_round=True,
                                             **common)
    else:
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        optimizer = torch.optim.AdamW(params, lr=train.lr, **common,
                                      **({"fused": True} if fused else {"foreach": True}))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))


def _reproducible_sr_adamw() -> type:
    """torchao's AdamW whose stochastic rounding draws from torch's generator as eager code
    would (inductor's ``fallback_random``), so a run is reproducible from its seed and a
    resumed run (whose checkpoint restores the generators) equals one never stopped."""
    from torchao.optim import _AdamW

    class AdamWBf16SR(_AdamW):
        def step(self, closure=None):
            with torch._inductor.config.patch(fallback_random=True):
                return super().step(closure)

    return AdamWBf16SR


def lr_lambda(recipe: Any):
    warmup, total, floor = recipe.train.warmup_steps, recipe.train.max_steps, recipe.train.min_lr_ratio

    def factor(step: int) -> float:
        # step counts completed optimizer steps: 0 for the first step.
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def state_gib(model: torch.nn.Module, optimizer: Any) -> dict[str, float]:
    """This rank's bytes (GiB) of weights, gradients and optimizer states, as they stand:
    read after a backward and an optimizer step, it shows what frozen units and sharding
    save. A DTensor counts its local shard."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"weights": sum(local(p) for p in params) / 2**30,
            "gradients": sum(local(p.grad) for p in params if p.grad is not None) / 2**30,
            "optimizer": sum(local(v) for v in states) / 2**30,
            "trainable_params": sum(p.numel() for p in params if p.requires_grad)}
