"""Test helpers: a recipe's model built through its adapter, as the core does."""

from __future__ import annotations

from weft.core.plugin_manager import build_plugin_manager


def adapter_of(recipe):
    return build_plugin_manager(entry_points=False).models.for_recipe(recipe)


def build_model(recipe, *, device="cpu", seed=0):
    return adapter_of(recipe).build(recipe, device=device, seed=seed)


def optimizer_for(recipe, model, *, world_size=1):
    """The optimizer and schedule a run of ``recipe`` makes for ``model`` (its plan's groups)."""
    import torch

    from weft.core.context import RunContext
    from weft.core.plan.planner import plan_recipe
    from weft.core.train.optimizer import make_optimizer

    pm = build_plugin_manager(entry_points=False)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=world_size, model=model)
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"))
    return make_optimizer(recipe, model, plan=plan, pm=pm, ctx=ctx)
