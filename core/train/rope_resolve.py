"""The text decoder's rotary scaling from the Plan's ``rope`` decision (``weft_rope``).

The hook answers with the recipe's ``[model]`` rotary keys; the recipe is evolved with
them, and the model built from that recipe, so a rule and the keys are one mechanism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from weft.core.errors import PlanError
from weft.core.recipe import Recipe

if TYPE_CHECKING:
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe.rule_engine import Plan

_KEYS = ("rope_scaling", "rope_factor", "rope_original_max")


def resolve_rope(recipe: Recipe, *, plan: Plan, pm: WeftPluginManager) -> Recipe:
    """``recipe`` with the rotary keys its text decoder's ``rope`` decision chooses."""
    decisions = [m.get("rope") for m in plan.modules_for("rope") if m.info.modality == "text"]
    if not decisions:
        return recipe
    decision = decisions[0]
    keys = pm.rope(decision=decision, recipe=recipe, plan=plan)
    if not keys:
        return recipe
    unknown = set(keys) - set(_KEYS)
    if unknown:
        raise PlanError(f"rope strategy {decision.strategy!r} answered keys {sorted(unknown)}; accepted: "
                        f"{', '.join(_KEYS)}", where=decision.source)
    model = recipe.model
    if model.rope_scaling != "none" and any(getattr(model, k) != v for k, v in keys.items()):
        raise PlanError(f"[model] rope_scaling = {model.rope_scaling!r} (factor {model.rope_factor:g}) and the rule "
                        f"{decision.rule!r} (rope = {decision.strategy!r}, {keys}) both set the rotary scaling; keep "
                        "one of them", where=decision.source)
    try:
        return attrs.evolve(recipe, model=attrs.evolve(model, **keys))
    except ValueError as error:
        raise PlanError(f"the rule {decision.rule!r}: {error}", where=decision.source) from None
