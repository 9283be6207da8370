"""Rope hook: the text decoder's rotary scaling, chosen by rule.

    [[rules]]
    when = { modality = "text", seq_len = { gt = 32768 } }
    rope = { strategy = "yarn", factor = 4.0 }        # or factor = "auto"

Strategies answer with the recipe's ``[model]`` rotary keys, which stay the shorthand
(``rope_scaling``, ``rope_factor``, ``rope_original_max``): the model is built from them
exactly as from the keys, and transformers computes the tables from its own
``rope_parameters`` (yarn, linear, dynamic). ``auto`` (the default rules') keeps the
recipe's keys. ``factor = "auto"``: the smallest factor whose stretched context holds
every position of ``train.seq_len`` tokens (a bound: mRoPE images and packed documents
keep position ids below the token count; `weft plan --positions` reads the data for the
tight one).
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Declared, NoParams, Strategy


def _above_one(instance, attribute, value) -> None:
    if value != "auto" and not value > 1.0:
        raise ValueError(f"{attribute.name} must be above 1 or \"auto\", got {value!r}")


@attrs.frozen(kw_only=True)
class ScalingParams:
    factor: float | Literal["auto"] = attrs.field(default="auto", validator=_above_one, metadata={
        "doc": "the context grows to original_max x factor; auto: enough for train.seq_len positions"})
    original_max: int = attrs.field(default=0, validator=in_range(low=0), metadata={
        "doc": "positions the model was trained on; 0 = model.rope_original_max, else its config's"})


# Each strategy's ``impl(params, *, recipe, plan)`` -> the recipe's [model] rotary keys it sets.

def _scaled(kind: str):
    """The context stretched by ``factor`` with transformers' ``kind`` scaling (yarn, linear, dynamic)."""

    def impl(params, *, recipe, plan):
        original = params.original_max or recipe.model.rope_original_max
        factor = params.factor
        if factor == "auto":
            from weft.plugins.models.build import model_config, text_config
            from weft.strategies.model.yarn import needed_factor, trained_positions

            unscaled = attrs.evolve(recipe, model=attrs.evolve(recipe.model, rope_scaling="none", rope_factor=1.0))
            text = text_config(model_config(unscaled)[0])
            trained = trained_positions(text.rope_parameters or {},
                                        max_position_embeddings=text.max_position_embeddings, original=original)
            factor = needed_factor(plan.seq_len - 1, trained=trained)
            if factor <= 1.0:
                return dict(_AS_SHIPPED)  # the trained context already holds seq_len
        return {"rope_scaling": kind, "rope_factor": float(factor), "rope_original_max": original}

    return impl


#: The recipe keys of the rotary embedding as the model ships.
_AS_SHIPPED = {"rope_scaling": "none", "rope_factor": 1.0}

STRATEGIES = Declared(
    Strategy(point="rope", name="auto", params=NoParams, impl=lambda params, **_: {},
             summary="the recipe's [model] rotary keys"),
    Strategy(point="rope", name="none", params=NoParams, impl=lambda params, **_: dict(_AS_SHIPPED),
             summary="the rotary embedding as the model ships"),
    Strategy(point="rope", name="yarn", params=ScalingParams, impl=_scaled("yarn"),
             summary="YaRN: low frequencies interpolated, high ones kept, attention temperature scaled"),
    Strategy(point="rope", name="linear", params=ScalingParams, impl=_scaled("linear"),
             summary="position interpolation: positions divided by the factor"),
    Strategy(point="rope", name="dynamic", params=ScalingParams, impl=_scaled("dynamic"),
             summary="dynamic NTK: the base grows with the sequence past the trained context"),
)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_rope(decision, recipe, plan):
    return STRATEGIES.answer(decision, recipe=recipe, plan=plan)
