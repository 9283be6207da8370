"""Optimizer hook: the built-in optimizers, chosen by ``optimizer`` rules per module.

``adamw_sr`` (the default): float32 math with stochastic rounding of bf16 weights and
moments, so no update is lost at fine-tuning learning rates; torch's own AdamW for
float32 weights (strategies/optim/adamw_sr.py). ``adamw``: torch's fused AdamW in the weights'
dtype, which rounds bf16 updates to nearest (explicit choice only). ``adamw_8bit``:
torchao's AdamW with 8-bit moments (seed 001's "8-bit AdamW"), stochastic rounding of bf16
weights. Every strategy takes the per-module settings ``lr`` / ``lr_scale`` /
``weight_decay``; the core resolves them into each group (core/train/optimizer_setup.py).
"""

from __future__ import annotations

import functools
from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Declared, Strategy


@attrs.frozen(kw_only=True)
class GroupSettings:
    lr: float | None = attrs.field(default=None, validator=attrs.validators.optional(in_range(low=0.0)), metadata={
        "doc": "peak learning rate of these modules; default train.lr (the schedule scales it like the rest)"})
    lr_scale: float = attrs.field(default=1.0, validator=in_range(low=0.0), metadata={
        "doc": "multiplies the group's peak learning rate (e.g. 10 for a projector at 10x the LLM's)"})
    weight_decay: float | None = attrs.field(default=None, validator=attrs.validators.optional(in_range(low=0.0)),
                                             metadata={"doc": "decoupled weight decay; default train.weight_decay"})

    def state_bytes(self, storage: int) -> float:
        """Optimizer state per parameter stored in ``storage`` bytes (`weft plan --estimate`)."""
        return 2 * storage  # AdamW's two moments in the weights' dtype

    def torch_keys(self) -> dict:
        """What the strategy's torch optimizer reads from a parameter group besides lr and weight decay."""
        return {}


@attrs.frozen(kw_only=True)
class AdamWParams(GroupSettings):
    pass


@attrs.frozen(kw_only=True)
class AdamWSRParams(GroupSettings):
    state_dtype: Literal["param", "float32"] = attrs.field(default="param", metadata={
        "doc": "the moments' dtype: param (bf16 for bf16 weights, rounded stochastically) or float32 "
               "(4 more bytes per parameter, exact moments)"})

    def state_bytes(self, storage: int) -> float:
        return 8 if self.state_dtype == "float32" else 2 * storage

    def torch_keys(self) -> dict:
        return {"state_dtype": self.state_dtype}


@attrs.frozen(kw_only=True)
class AdamW8bitParams(GroupSettings):
    def state_bytes(self, storage: int) -> float:
        return 2 + 2 * 4 / 256  # two 8-bit moments and a float32 scale per block of 256 (torchao)


def _torchao_missing(params, *, recipe, plan) -> str | None:
    try:
        from torchao.optim import AdamW8bit  # noqa: F401 - optional extra: pip install weft[sr]
    except Exception as error:  # ImportError, or a broken install
        return f"optimizer 'adamw_8bit' needs torchao (pip install 'weft[sr]'): {type(error).__name__}: {error}"
    return None


def _making(make):
    """``impl(params, *, groups, recipe, ctx)`` of a strategy whose optimizer ``make(torch_groups, lr=,
    betas=)`` builds; each group takes its rule's settings and its params' own keys (``torch_keys``)."""

    def impl(params, *, groups, recipe, ctx):
        train = recipe.train
        torch_groups = [{"params": list(g.params), "lr": g.lr, "weight_decay": g.weight_decay,
                         **g.decision.params.torch_keys()} for g in groups]
        return make(torch_groups, lr=train.lr, betas=(train.beta1, train.beta2))

    return impl


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_optimizer(decision, groups, recipe, ctx):
    return STRATEGIES.answer(decision, groups=groups, recipe=recipe, ctx=ctx)


def _adamw_sr(groups, *, lr, betas):
    from weft.strategies.optim.adamw_sr import AdamWSR

    return AdamWSR(groups, lr=lr, betas=betas)


def _adamw(groups, *, lr, betas):
    import torch

    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if fused else {"foreach": True}))


def _adamw_8bit(groups, *, lr, betas):
    import torch

    bf16 = any(p.dtype == torch.bfloat16 for g in groups for p in g["params"])
    optimizer = _reproducible(_torchao_8bit())(groups, lr=lr, betas=betas, bf16_stochastic_round=bf16)
    optimizer.bf16_rounding = "stochastic" if bf16 else "nearest"
    return optimizer


def _torchao_8bit() -> type:
    from torchao.optim import AdamW8bit

    return AdamW8bit


@functools.cache
def _reproducible(base: type) -> type:
    """A torchao optimizer whose stochastic rounding draws from torch's generator as eager
    code would (inductor's ``fallback_random``): reproducible from the seed and across
    ``--resume`` (the checkpoint restores the generators)."""
    import torch

    class Reproducible(base):
        def step(self, closure=None):
            with torch._inductor.config.patch(fallback_random=True):
                return super().step(closure)

    Reproducible.__name__ = base.__name__
    return Reproducible


STRATEGIES = Declared(
    Strategy(point="optimizer", name="adamw_sr", params=AdamWSRParams, impl=_making(_adamw_sr),
             summary="AdamW in float32 math; bf16 weights and moments rounded stochastically (no update "
                     "lost); torch's AdamW for float32 weights"),
    Strategy(point="optimizer", name="adamw", params=AdamWParams, impl=_making(_adamw),
             summary="torch's AdamW (fused on CUDA) in the weights' dtype: bf16 updates rounded to nearest"),
    Strategy(point="optimizer", name="adamw_8bit", params=AdamW8bitParams, check=_torchao_missing,
             impl=_making(_adamw_8bit),
             summary="torchao's AdamW with 8-bit moments; bf16 weights rounded stochastically"),
)
