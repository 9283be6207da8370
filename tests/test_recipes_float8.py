"""The bundled float8 recipes are their bf16 recipes with float8 on the decoder layers' rules
and nothing else (one layout to keep, not two), and `weft plan` converts all the decoder's
linear layers of the 7B with them."""

from __future__ import annotations

import copy
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.quick
@pytest.mark.parametrize("length", ["32k", "128k"])
def test_a_float8_recipe_is_its_bf16_recipe_with_float8_decoder_layers(length):
    from weft.core.recipe import Recipe

    base = Recipe.from_toml(ROOT / "recipes" / f"qwen2.5-vl-7b-{length}-1gpu.toml").raw
    float8 = Recipe.from_toml(ROOT / "recipes" / f"qwen2.5-vl-7b-{length}-float8-1gpu.toml").raw
    expected, converted = copy.deepcopy(base), 0
    for rule in expected["rules"]:
        if rule.get("when", {}).get("path", "").startswith("*.language_model.layers."):
            rule["shard"].update(matmul="float8", float8_recipe="tensorwise")
            converted += 1
    assert converted >= 1 and float8 == expected


def test_plan_converts_every_decoder_linear_of_the_7b(weft):
    pytest.importorskip("torchao")
    done = weft("plan", "qwen2.5-vl-7b-32k-float8-1gpu")
    assert done.returncode == 0, done.stderr[-2000:]
    out = " ".join(done.stdout.split())
    # 28 layers x 7 linears (q, k, v, o, gate, up, down), in two rules: layers 0-9 and the rest.
    assert "float8 matmuls: 70 linear layers in 10 units by rule 'decoder layers 0-9" in out
    assert 'float8 matmuls: 126 linear layers in 18 units by rule "decoder layers: keep attention' in out
