"""`shard = { matmul = "float8" }`: which linear layers a rule converts (on the meta device:
torchao's Float8Linear, names unchanged), and the messages where float8 cannot run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

FLOAT8 = ('[model]\npreset = "qwen2_5_vl_tiny"\n[train]\nmicro_batch_tokens = 1024\nmax_steps = 2\n'
          'precision = "bf16"\ncheckpoint_every = -1\n[parallel]\nnproc = 1\n[[rules]]\nname = "float8 text layers"\n'
          'when = { path = "*.language_model.layers.*" }\n'
          'shard = { strategy = "none", matmul = "float8", float8_recipe = "tensorwise" }\n'
          '[[rules]]\nname = "the rest whole"\nshard = { strategy = "none" }\n')


def _meta_model_and_plan(tmp_path, text=FLOAT8):
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe

    (tmp_path / "f8.toml").write_text(text)
    recipe = Recipe.from_toml(str(tmp_path / "f8.toml"))
    pm = build_plugin_manager(entry_points=False)
    model = pm.models.for_recipe(recipe).build(recipe, device="meta", seed=0)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=1, model=model)
    return model, plan


@pytest.mark.quick
def test_the_rule_converts_the_units_linear_layers_and_nothing_else(tmp_path):
    from weft.strategies.model.float8 import convert

    model, plan = _meta_model_and_plan(tmp_path)
    units = [u for u in plan.modules_for("shard") if getattr(u.get("shard").params, "matmul", "") == "float8"]
    assert [u.info.path for u in units] == ["model.language_model.layers.0", "model.language_model.layers.1"]
    names = {u.info.path: convert(model.get_submodule(u.info.path), recipe=u.get("shard").params.float8_recipe)
             for u in units}
    linears = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]
    assert all(sorted(found) == sorted(linears) for found in names.values()), names
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["model.language_model.layers.0.mlp.up_proj"] == "Float8Linear"
    assert kinds["lm_head"] == "Linear" and all(k == "Linear" for n, k in kinds.items() if ".visual." in n)
    # Names and parameters unchanged: checkpoints and exports keep their keys.
    assert "model.language_model.layers.0.mlp.up_proj.weight" in dict(model.named_parameters())


@pytest.mark.quick
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp", "tensorwise"])
def test_each_recipe_is_torchaos_own(recipe):
    """Each accepted recipe converts with torchao's configuration of that name; with_gw_hp
    leaves the weight gradient's product unscaled (in the storage dtype)."""
    from torchao.float8.config import ScalingType

    from weft.strategies.model.float8 import RECIPES, convert

    assert recipe in RECIPES
    block = torch.nn.Sequential(torch.nn.Linear(64, 128, device="meta"))
    assert convert(block, recipe=recipe) == ["0"]
    config = block[0].config
    high = config.cast_config_input_for_grad_weight.scaling_type == ScalingType.DISABLED
    assert high == (recipe == "rowwise_with_gw_hp"), config


@pytest.mark.quick
def test_adapters_layers_and_odd_dimensions_stay_as_they_are():
    from weft.strategies.model.float8 import eligible

    assert eligible(torch.nn.Linear(64, 128, device="meta"), "mlp.up_proj")
    assert not eligible(torch.nn.Linear(64, 120 + 1, device="meta"), "mlp.up_proj")  # not a multiple of 16
    assert not eligible(torch.nn.Linear(64, 16, device="meta"), "mlp.up_proj.lora_A.default")


@pytest.mark.parametrize("nproc", [1, 2])
def test_float8_where_the_device_has_no_float8_units_is_the_rules_error(weft, tmp_path, nproc):
    """Met on the ranks (the device is theirs): with 2, every rank meets it and the launcher
    says it once, whichever rank ends first (core/run/rank_errors.py)."""
    (tmp_path / "f8.toml").write_text(FLOAT8)
    done = weft("run", "f8.toml", "--run-dir", "run", "--nproc", str(nproc), cwd=tmp_path)
    message = " ".join(done.stderr.split())
    assert done.returncode == 2 and "shard rule 'float8 text layers' asks for matmul = 'float8'" in message
    assert "the cpu device has no float8 matrix units" in message and "f8.toml:" in message
    assert message.count("weft: error:") == 1, message


def test_float8_and_a_4bit_base_on_one_unit_are_refused(weft, tmp_path):
    text = FLOAT8.replace('float8_recipe = "tensorwise" }', 'quantize = "nf4", trainable = false }')
    (tmp_path / "f8.toml").write_text(text)
    done = weft("plan", "f8.toml", cwd=tmp_path)
    assert done.returncode == 2 and "a 4-bit weight is not multiplied in float8" in " ".join(done.stderr.split())


def test_plan_says_which_linear_layers_multiply_in_float8(weft, tmp_path):
    (tmp_path / "f8.toml").write_text(FLOAT8)
    done = weft("plan", "f8.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("float8 matmuls: 14 linear layers in 2 units by rule 'float8 text layers' (" in done.stdout
            and "e.g. model.language_model.layers.0.self_attn.q_proj" in done.stdout)


@pytest.mark.parametrize("checkpoint", ["full", "except_attention"])
def test_emulated_float8_trains_through_the_loop_near_bf16(weft, tmp_path, checkpoint):
    """float8_emulate = true: torchao's float8 casts with high-precision products, so the whole
    loop (recomputation, whole or but the attention kernel's outputs; the optimizer) runs
    float8's numerics on the CPU. The
    loss is bf16's within float8's error, but not bf16's (the casts are in use)."""
    import json

    losses = {}
    for name, extra in (("bf16", ""), ("float8", ', float8_emulate = true')):
        text = FLOAT8.replace('float8_recipe = "tensorwise" }', f'float8_recipe = "rowwise"{extra}, '
                              f'checkpoint = "{checkpoint}" }}').replace("max_steps = 2", "max_steps = 3")
        if name == "bf16":
            text = text.replace('matmul = "float8", float8_recipe = "rowwise", ', "")
        (tmp_path / f"{name}.toml").write_text(text)
        done = weft("run", f"{name}.toml", "--run-dir", name, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in metrics]
    assert len(losses["float8"]) == 3
    for bf16, float8 in zip(losses["bf16"], losses["float8"]):
        assert bf16 != float8 and abs(float8 - bf16) / bf16 < 0.02, losses


def test_an_unknown_scaling_is_a_message_naming_the_key_and_the_scalings(weft, tmp_path):
    """The rule key's accepted values are strategies/model/float8_scalings.py's (one place)."""
    from weft.strategies.model.float8_scalings import RECIPES

    (tmp_path / "f8.toml").write_text(FLOAT8.replace('float8_recipe = "tensorwise"', 'float8_recipe = "blockwise"'))
    done = weft("plan", "f8.toml", cwd=tmp_path)
    message = " ".join(done.stderr.split())
    assert done.returncode == 2 and "float8_recipe" in message and "'blockwise'" in message, message
    assert all(name in message for name in RECIPES) and "Traceback" not in done.stderr, message
