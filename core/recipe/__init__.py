"""The recipe and the rule language: TOML into frozen attrs sections, rules, the Plan, presets. No torch.

``weft.core.recipe.Recipe`` is the import path plugins and docs use (docs/hooks.md): the
classes live in recipe.py and data.py beside the rest of the language.
"""

from weft.core.recipe.data import DataSection, EvalSection
from weft.core.recipe.recipe import ModelSection, ParallelSection, Recipe, TrainSection, apply_override

__all__ = ["DataSection", "EvalSection", "ModelSection", "ParallelSection", "Recipe", "TrainSection", "apply_override"]
