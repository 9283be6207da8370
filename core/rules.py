"""The path plugin authors import the Plan's types from (docs/hooks.md, docs/plugins.md):
``from weft.core.rules import Plan, Decision, ModuleInfo, build_plan``. The rule engine
lives in core/recipe/rule_engine.py."""

from weft.core.recipe.rule_engine import Decision, ModuleInfo, Plan, build_plan

__all__ = ["Decision", "ModuleInfo", "Plan", "build_plan"]
