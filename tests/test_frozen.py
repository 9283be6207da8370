"""Frozen units by rule (`shard = { ..., trainable = false }`): the vision tower frozen, the
projector and text trained. `weft check` under ring 2 is exact with the reference frozen
alike (and fails when only one side freezes); a run leaves the frozen weights as they were
and gives them no optimizer state."""

from __future__ import annotations

import json
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
FROZEN = ('[model]\npreset = "qwen2_5_vl_tiny"\n[data]\nnum_samples = 64\n[train]\nmicro_batch_tokens = 1024\n'
          'checkpoint_every = 0\nmax_steps = 2\n[[rules]]\nname = "vision tower frozen"\n'
          'when = { path = "*.visual.blocks.*" }\nshard = { strategy = "fsdp2", trainable = false }\n')


def test_check_under_ring2_with_the_vision_tower_frozen(weft, tmp_path):
    (tmp_path / "frozen.toml").write_text(FROZEN)
    done = weft("check", "frozen.toml", "--world-size", "2", "--set", "parallel.ring=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["frozen_units"] == ["model.visual.blocks.0", "model.visual.blocks.1"]
    assert result["grad_params"]["plan"] == result["grad_params"]["reference"]


def test_a_side_that_does_not_freeze_fails_the_check():
    from weft.core.commands.check import compare

    grads = {"a.weight": torch.ones(2), "b.weight": torch.ones(2)}
    ref = {"loss": 1.0, "grads": {"a.weight": torch.ones(2)}, "grad_norm": 1.0, "groups": {"a.weight": "text"}}
    got = {"loss": 1.0, "grads": grads, "grad_norm": 1.0}
    assert not compare(ref, got)["ok"]


def test_frozen_weights_stay_and_get_no_optimizer_state(weft, tmp_path):
    from model_helpers import optimizer_for
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    (tmp_path / "frozen.toml").write_text(FROZEN)
    done = weft("run", "frozen.toml", "--nproc", "1", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # The summary's state memory: AdamW's two float32 moments (and a step count) per trained
    # parameter only, and no gradient for a frozen one.
    state = json.loads((tmp_path / "run" / "summary.json").read_text())["state_gib"]
    trained_bytes = state["trainable_params"] * 4
    assert abs(state["optimizer"] * 2**30 - 2 * trained_bytes) < 4096
    assert state["gradients"] * 2**30 == trained_bytes < state["weights"] * 2**30
    assert weft("export", "run", "hf", cwd=tmp_path).returncode == 0
    from transformers import Qwen2_5_VLForConditionalGeneration

    trained = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf").state_dict()  # transformers' names
    recipe = Recipe.from_toml(str(tmp_path / "frozen.toml"))
    family = plugin_manager_from_env().models.for_recipe(recipe)
    initial = family.build(recipe, device="cpu", seed=recipe.train.seed).state_dict()
    blocks = [k for k in trained if ".visual.blocks." in k]
    assert blocks and all(torch.equal(trained[k], initial[k]) for k in blocks)
    assert not torch.equal(trained["model.visual.merger.mlp.0.weight"], initial["model.visual.merger.mlp.0.weight"])
    layers = [k for k in trained if "language_model.layers.0.mlp" in k]
    assert any(not torch.equal(trained[k], initial[k]) for k in layers)
    model = family.build(recipe, device="cpu", seed=0)
    for block in model.model.visual.blocks:
        block.requires_grad_(False)
    optimizer, _ = optimizer_for(recipe, model)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in held for p in model.model.visual.blocks.parameters())


def test_plan_says_what_trains(weft, tmp_path):
    """`weft plan` counts the parameters outside frozen units (the tiny tower's two blocks)."""
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    (tmp_path / "frozen.toml").write_text(FROZEN)
    done = weft("plan", "frozen.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    recipe = Recipe.from_toml(str(tmp_path / "frozen.toml"))
    model = plugin_manager_from_env().models.for_recipe(recipe).build(recipe, device="meta", seed=0)
    total = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.visual.blocks.parameters())
    assert f"trains {total - tower:,} of {total:,} parameters" in " ".join(done.stdout.split())
    assert "2 units, model.visual.blocks.0 ... model.visual.blocks.1" in " ".join(done.stdout.split())
