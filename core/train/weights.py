"""The one place a run's model gets its storage and weights (the model family's ``materialize``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import Plan


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any of the model's parameters or buffers (an FSDP2 shard's local part too) has
    no storage yet."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def materialize_weights(model: torch.nn.Module, *, family: Any, recipe: Recipe, plan: Plan, device: torch.device,
                        log: Any) -> bool:
    """Give a meta-device model (sharded or not) its storage on ``device`` and its weights, the
    units whose shard rule asks for 4 bits quantised one at a time as they materialise (the
    rank holds the 4-bit model and one unit in full precision). Called where the weights must
    exist: by a shard strategy that quantises before sharding (FSDP2 shards a 4-bit weight as
    its NF4 chunks), else by the core after ``weft_shard``, each rank then materialising only
    its shards. A model already materialised is left as it is; returns whether it was now."""
    if not on_meta(model):
        return False
    quantize = plan.quantized_units()  # passed only when asked: a family's own materialize may not take it
    family.materialize(model, recipe, device=device, seed=recipe.train.seed, log=log,
                        **({"quantize": quantize} if quantize else {}))
    return True
