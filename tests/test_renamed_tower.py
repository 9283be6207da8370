"""A model family whose vision tower is not called ``visual`` (tests/weft_renamed_tower.py:
tiny Qwen2.5-VL with the tower at ``model.image_encoder``) plans and runs its attention alike.

`weft plan` resolves attention ``auto`` once, per module, from its declared modality; the run
installs exactly what the plan's decisions name. Packed documents make text ``auto`` differ from
vision ``auto`` on one rank (ring, which reads document ids, against the tower's own): a tower
taken for text by its name would get ring. Under Ulysses the tower's ``auto`` splits no heads
(it keeps images whole), and the model still equals the unsharded one.
"""

from __future__ import annotations

import json
import re

import pytest

import weft_renamed_tower
from distributed import run_ranks, sp_model
from plugin_site import plugin_env

PLUGIN = "weft_renamed_tower"
TOWER_ATTN = re.compile(r"model\.image_encoder\.blocks\.\d+\.attn")
TEXT_ATTN = re.compile(r"model\.language_model\.layers\.\d+\.self_attn")


def installed_strategy(name: str) -> str:
    """The strategy behind an attention implementation name as the built-in plugin registers
    it (plugins/attention.py weft_attention): transformers' own names, or weft_[flash_]<strategy>_..."""
    found = re.fullmatch(r"(sdpa|eager)|weft_(?:flash_)?(vision_local|vision_ulysses|ring|ulysses|usp|local)_.+",
                         name)
    assert found, name
    return found.group(1) or found.group(2)


def recipe_text(preset, *, pack: bool) -> str:
    return (f'[model]\npreset = "{preset}"\n\n[data]\nsource = "synthetic"\nnum_samples = 8\nmin_side = 28\n'
            'max_side = 56\n\n[train]\nmax_steps = 1\nmicro_batch_tokens = 1024\nprecision = "fp32"\n\n'
            '[parallel]\nnproc = 1\n'
            + ('\n[[rules]]\nname = "pack"\nbatching = { strategy = "token_budget", pack = true }\n' if pack else ""))


def attention_of(plan_json: dict, pattern: re.Pattern) -> list[dict]:
    found = [m["decisions"]["attention"] for m in plan_json["modules"] if pattern.fullmatch(m["path"])]
    assert len(found) == 2, [m["path"] for m in plan_json["modules"]]
    return found


def test_weft_plan_resolves_attention_as_the_run_installs_it(weft, tmp_path):
    env = plugin_env(tmp_path / "plugins", module=PLUGIN, entry="renamed-tower")
    recipe = tmp_path / "renamed.toml"
    recipe.write_text(recipe_text(weft_renamed_tower.write_preset(tmp_path), pack=True))

    planned = weft("plan", recipe, "--world-size", "1", "--json", cwd=tmp_path, env=env)
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads(planned.stdout)
    assert plan["model"] == "renamed_tower_vl"
    assert not any("visual" in m["path"] for m in plan["modules"])
    vision, text = attention_of(plan, TOWER_ATTN), attention_of(plan, TEXT_ATTN)
    # Both from the default rules' 'auto', resolved in the plan: the tower its own, text ring.
    assert all(d["resolved_from"] == "auto" for d in vision + text)
    assert {d["strategy"] for d in vision} <= {"sdpa", "vision_local"} and len({d["strategy"] for d in vision}) == 1
    assert {d["strategy"] for d in text} == {"ring"}
    explained = weft("plan", recipe, "--world-size", "1", "--explain", cwd=tmp_path, env=env)
    assert explained.returncode == 0, explained.stderr[-3000:]
    rows = [line for line in explained.stdout.splitlines()
            if TOWER_ATTN.search(line) and re.search(r"│ attention\s+│", line)]
    assert len(rows) == 2 and all(f"auto -> {vision[0]['strategy']}" in row for row in rows), rows

    run_dir = tmp_path / "run"
    ran = weft("run", recipe, "--run-dir", run_dir, cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr[-4000:]
    installed = next(json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()
                     if json.loads(line)["event"] == "attention.installed")
    assert installed_strategy(installed["vision_config"]) == vision[0]["strategy"]
    assert installed_strategy(installed["text_config"]) == "ring"
    # The run planned what `weft plan` showed: the same decisions for every attention module.
    run_plan = json.loads((run_dir / "plan.json").read_text())
    assert attention_of(run_plan, TOWER_ATTN) == vision and attention_of(run_plan, TEXT_ATTN) == text


@pytest.mark.quick
def test_the_towers_auto_splits_no_heads(tmp_path):
    """Ulysses 4 over a tower of 2 heads: the tower's resolved strategy splits none, so it plans;
    the text's (4 heads) is ulysses. A rule that splits the tower's heads is refused."""
    from weft.core.errors import PlanError
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe

    pm = build_plugin_manager(extra=[(PLUGIN, weft_renamed_tower)], entry_points=False)
    preset = str(weft_renamed_tower.write_preset(tmp_path))
    plan, _ = plan_recipe(Recipe.from_dict({"model": {"preset": preset}, "parallel": {"ulysses": 4}}),
                          pm=pm, world_size=4)
    attention = {m.info.path: m.get("attention") for m in plan.modules_for("attention")}
    vision = [d for path, d in attention.items() if TOWER_ATTN.fullmatch(path)]
    text = [d for path, d in attention.items() if TEXT_ATTN.fullmatch(path)]
    assert len(vision) == len(text) == 2 and all(d.resolved_from == "auto" for d in vision + text)
    assert {d.strategy for d in vision} <= {"sdpa", "vision_local"} and {d.strategy for d in text} == {"ulysses"}
    splitting = {"model": {"preset": preset}, "parallel": {"ulysses": 4},
                 "rules": [{"when": {"modality": "vision"}, "attention": "ulysses"}]}
    with pytest.raises(PlanError, match=r"model\.image_encoder\.blocks\.0\.attn has 2 heads, which attention "
                                        r"strategy 'ulysses' .* splits over ulysses = 4 ranks"):
        plan_recipe(Recipe.from_dict(splitting), pm=pm, world_size=4)


def _sp_rank(rank: int, world: int, preset: str) -> None:
    from test_sp_vl import _check

    for ulysses, ring, text in ((2, 1, "ulysses"), (1, 2, "ring")):
        model, _, plan, _, _ = sp_model({"model": {"preset": preset}, "parallel": {"ulysses": ulysses, "ring": ring}},
                                        rank=rank, world=world, plugins=(PLUGIN,))
        config = model.config
        for module in plan.modules_for("attention"):
            decision, tower = module.get("attention"), module.info.modality
            assert decision.resolved_from == "auto", module.info.path
            implementation = (config.vision_config if tower == "vision" else config.text_config)._attn_implementation
            assert installed_strategy(implementation) == decision.strategy, module.info.path
            assert decision.strategy == text if tower == "text" else decision.strategy in ("sdpa", "vision_local")
        # The SP hooks find the tower by its modality: images are spread over the ranks.
        family = weft_renamed_tower.RENAMED_TOWER
        assert family.vision_tower(model) is model.model.image_encoder
        _check(rank, world, preset=preset, ulysses=ulysses, ring=ring, strategy="auto", layout="zigzag",
               plugins=(PLUGIN,))


def test_under_sequence_parallelism_the_run_installs_the_plan_and_equals_unsharded(tmp_path):
    """Two ranks, Ulysses then ring, default rules: each attention module gets the plan's
    strategy, and loss and gradients equal the unsharded model's (tests/test_sp_vl.py's bar)."""
    run_ranks(2, _sp_rank, str(weft_renamed_tower.write_preset(tmp_path)))


@pytest.mark.quick
def test_choices_a_module_cannot_run_are_refused_when_planning(tmp_path):
    """What the run would refuse at install, the plan refuses per module, by modality: sdpa on
    packed text (it reads no document ids; the tower's sdpa is fine), vision_local on text."""
    from weft.core.errors import PlanError
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe

    pm = build_plugin_manager(extra=[(PLUGIN, weft_renamed_tower)], entry_points=False)
    preset = str(weft_renamed_tower.write_preset(tmp_path))
    pack = {"batching": {"strategy": "token_budget", "pack": True}}

    def plan(*rules):
        return plan_recipe(Recipe.from_dict({"model": {"preset": preset}, "rules": list(rules)}), pm=pm,
                           world_size=1)[0]

    assert {m.get("attention").strategy for m in plan(pack, {"when": {"modality": "vision"}, "attention": "sdpa"})
            .modules_for("attention") if m.info.modality == "vision"} == {"sdpa"}
    with pytest.raises(PlanError, match=r"language_model\.layers\.0\.self_attn: packed documents .* 'sdpa' does not"):
        plan(pack, {"attention": "sdpa"})
    with pytest.raises(PlanError, match=r"language_model\.layers\.0\.self_attn: attention 'vision_local' is for"):
        plan({"attention": "vision_local"})
    local = plan({"attention": "local"}).modules_for("attention")
    assert {(m.info.modality, m.get("attention").strategy, m.get("attention").resolved_from) for m in local} == {
        ("text", "local", ""), ("vision", "vision_local", "local")}
