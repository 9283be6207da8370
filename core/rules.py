"""The path plugin authors import the Plan's types from (docs/hooks.md, docs/plugins.md):
``from weft.core.rules import Plan, Decision, ModuleInfo, build_plan``. The rule engine
lives in core/recipe/rules.py."""

from weft.core.recipe.rules import Decision, ModuleInfo, Plan, build_plan

__all__ = ["Decision", "ModuleInfo", "Plan", "build_plan"]
