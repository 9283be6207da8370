"""Rotary scaling chosen by rule (`rope` hook point): a rule selecting YaRN, linear or
dynamic-NTK scaling by seq_len builds the same rotary tables as the `[model]` keys and as
transformers' own rotary embedding for the same numbers; "auto" factors; conflicts with the
keys are plan errors; the plan and `weft check` under ring 2 use it."""

from __future__ import annotations

import json

import pytest
import torch

from weft.core.errors import PlanError
from weft.core.plan.planner import plan_recipe
from weft.core.plugin_manager import plugin_manager_from_env
from weft.core.recipe import Recipe
from weft.core.train.rope_resolve import resolve_rope

PM = plugin_manager_from_env()
BASE = {"model": {"preset": "qwen2_5_vl_tiny"}, "train": {"micro_batch_tokens": 1024}}


def _recipe(*, rope: dict | None = None, model: dict | None = None, tokens: int = 1024) -> Recipe:
    data = {"model": dict(BASE["model"], **(model or {})), "train": {"micro_batch_tokens": tokens}}
    if rope is not None:
        data["rules"] = [{"name": "long text", "when": {"modality": "text", "seq_len": {"gt": 512}}, "rope": rope}]
    return Recipe.from_dict(data)


def _resolved(recipe: Recipe) -> Recipe:
    plan, _ = plan_recipe(recipe, pm=PM, world_size=1)
    return resolve_rope(recipe, plan=plan, pm=PM)


def _tables(recipe: Recipe):
    """The text decoder's rotary embedding as built for ``recipe``: inv_freq, attention scaling,
    and cos/sin at a few positions (3-D mRoPE ids)."""
    family = PM.models.for_recipe(recipe)
    model = family.build(recipe, device="cpu", seed=0)
    rotary = model.model.language_model.rotary_emb
    x = torch.zeros(1, 5, 1)
    positions = torch.tensor([0, 1, 1000, 9000, 30000]).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = rotary(x, positions)
    return rotary.inv_freq, rotary.attention_scaling, cos, sin


def _transformers_tables(kind: str, factor: float, original: int):
    """transformers' own rotary embedding with rope_parameters written by hand."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    config = PM.models.for_recipe(_recipe()).config(_recipe())[0].get_text_config()
    config.rope_parameters = {"rope_type": kind, "factor": factor, "original_max_position_embeddings": original,
                              "rope_theta": config.rope_parameters["rope_theta"],
                              "mrope_section": config.rope_parameters["mrope_section"]}
    if kind != "dynamic":
        config.max_position_embeddings = int(original * factor)
    rotary = Qwen2_5_VLRotaryEmbedding(config=config)
    x = torch.zeros(1, 5, 1)
    positions = torch.tensor([0, 1, 1000, 9000, 30000]).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = rotary(x, positions)
    return rotary.inv_freq, rotary.attention_scaling, cos, sin


def _equal(a, b) -> None:
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["yarn", "linear", "dynamic"])
def test_a_rule_builds_the_tables_of_the_model_keys_and_of_transformers(kind):
    by_rule = _resolved(_recipe(rope={"strategy": kind, "factor": 4.0}))
    by_keys = _recipe(model={"rope_scaling": kind, "rope_factor": 4.0})
    assert by_rule.model.rope_scaling == kind and by_rule.model.rope_factor == 4.0
    trained = 4096  # the tiny preset's max_position_embeddings
    _equal(_tables(by_rule), _tables(by_keys))
    _equal(_tables(by_rule), _transformers_tables(kind, 4.0, trained))
    plain = _tables(_recipe())
    assert not torch.equal(plain[2], _tables(by_rule)[2])  # the rule did change the tables


@pytest.mark.quick
def test_the_rule_applies_only_past_its_seq_len():
    short = _recipe(rope={"strategy": "yarn", "factor": 4.0}, tokens=512)  # seq_len 512: not > 512
    assert _resolved(short) is short and short.model.rope_scaling == "none"


@pytest.mark.quick
def test_auto_factor_covers_seq_len_positions():
    long = _resolved(_recipe(rope={"strategy": "yarn", "factor": "auto"}, tokens=20000))
    assert (long.model.rope_scaling, long.model.rope_factor) == ("yarn", 4.9)  # 20,000 / 4,096 -> 4.9
    fits = _resolved(_recipe(rope={"strategy": "yarn", "factor": "auto"}, tokens=4096))
    assert fits.model.rope_scaling == "none"  # the trained context already holds it


@pytest.mark.quick
def test_a_rule_against_the_model_keys_is_a_plan_error():
    both = _recipe(rope={"strategy": "yarn", "factor": 4.0}, model={"rope_scaling": "yarn", "rope_factor": 2.0})
    with pytest.raises(PlanError, match="both set the rotary scaling"):
        _resolved(both)
    same = _recipe(rope={"strategy": "yarn", "factor": 2.0}, model={"rope_scaling": "yarn", "rope_factor": 2.0})
    assert _resolved(same).model.rope_factor == 2.0  # agreeing is fine


def test_plan_explain_and_check_under_ring2_use_the_rule(weft, tmp_path):
    recipe = tmp_path / "rope.toml"
    recipe.write_text('[model]\npreset = "qwen2_5_vl_tiny"\n[data]\nnum_samples = 16\n[train]\n'
                      'micro_batch_tokens = 1024\n[[rules]]\nname = "long text: YaRN"\n'
                      'when = { modality = "text", seq_len = { gt = 512 } }\n'
                      'rope = { strategy = "yarn", factor = 4.0 }\n')
    plan = weft("plan", str(recipe), "--explain")
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "rotary context 16384 (yarn x4 over 4096 trained positions)" in plan.stdout
    assert "rope.toml:7" in plan.stdout and "long text: YaRN" in plan.stdout
    check = weft("check", str(recipe), "--world-size", "2", "--set", "parallel.ring=2", "--json")
    assert check.returncode == 0, check.stderr[-3000:]
    assert json.loads(check.stdout)["ok"]
