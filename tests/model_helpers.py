"""Test helpers: a recipe's model built through its adapter, as the core does."""

from __future__ import annotations

from weft.core.plugin_manager import build_plugin_manager


def adapter_of(recipe):
    return build_plugin_manager(entry_points=False).models.for_recipe(recipe)


def build_model(recipe, *, device="cpu", seed=0):
    return adapter_of(recipe).build(recipe, device=device, seed=seed)
