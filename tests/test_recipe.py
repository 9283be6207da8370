"""Recipes that are right: the bundled one, defaults, --set overrides, the raw data kept."""

from __future__ import annotations

import importlib.resources
import pathlib
import textwrap

import attrs
import pytest

from weft.core.errors import RecipeError
from weft.core.recipe import (
    DataSection,
    ModelSection,
    ParallelSection,
    Recipe,
    TrainSection,
    apply_override,
)
from weft.core.recipe.syntax import bundled_path

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)

TINY_VL = pathlib.Path(str(importlib.resources.files("weft.recipes"))) / "tiny-vl.toml"


def write(tmp_path: pathlib.Path, text: str, name: str = "recipe.toml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def test_bundled_tiny_vl_recipe_parses():
    recipe = Recipe.from_toml(TINY_VL)
    assert recipe.source == str(TINY_VL)
    assert recipe.model == ModelSection(preset="qwen2_5_vl_tiny")
    assert recipe.data.source == "synthetic" and recipe.data.path is None
    assert recipe.data.min_side <= recipe.data.max_side
    assert recipe.train.max_steps >= 1 and recipe.train.precision in ("fp32", "bf16")
    assert recipe.parallel.dp_shard == -1
    # Its rules are those of the included modality-groups file, in file order.
    groups = bundled_path("rules/modality-groups.toml")
    assert recipe.rules and all(r.source.startswith(f"{groups}:") for r in recipe.rules)
    assert recipe.raw["include"] == ["rules/modality-groups.toml"]


def test_defaults():
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}})
    assert recipe.data == DataSection()
    assert recipe.train == TrainSection()
    assert recipe.parallel == ParallelSection()
    assert recipe.rules == ()
    assert recipe.source == "<memory>"
    assert recipe.model.path is None and recipe.model.processor is None
    assert (recipe.data.source, recipe.data.num_samples, recipe.data.strict) == ("synthetic", 256, False)
    assert (recipe.train.max_steps, recipe.train.seed, recipe.train.precision, recipe.train.lr) == (20, 0, "fp32", 1e-3)
    assert (recipe.parallel.nproc, recipe.parallel.dp_replicate, recipe.parallel.dp_shard) == (1, 1, -1)
    assert (
        recipe.parallel.ulysses, recipe.parallel.ring, recipe.parallel.backend, recipe.parallel.device
    ) == (1, 1, "auto", "auto")



def test_seq_len_property():
    assert TrainSection().seq_len == TrainSection().micro_batch_tokens
    assert TrainSection(micro_batch_tokens=512, max_seq_len=4096).seq_len == 4096


def test_int_is_accepted_for_float_fields():
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "train": {"lr": 1, "beta1": 0}})
    assert recipe.train.lr == 1.0 and isinstance(recipe.train.lr, float)
    assert recipe.train.beta1 == 0.0 and isinstance(recipe.train.beta1, float)


def test_model_path_instead_of_preset():
    recipe = Recipe.from_dict({"model": {"path": "/models/Qwen2.5-VL-7B-Instruct", "processor": "tiny_vl"}})
    assert recipe.model == ModelSection(path="/models/Qwen2.5-VL-7B-Instruct", processor="tiny_vl")


def test_preset_given_as_a_path_is_not_checked_against_bundled_names():
    assert Recipe.from_dict({"model": {"preset": "presets/my_shape.toml"}}).model.preset == "presets/my_shape.toml"


def test_recipe_is_frozen():
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        recipe.train = TrainSection()  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        recipe.train.max_steps = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------
# --set
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, section, key, value",
    [
        ("train.max_steps=5", "train", "max_steps", 5),
        ("train.max_steps = 7", "train", "max_steps", 7),  # spaces around '='
        ("train.lr=1e-4", "train", "lr", 1e-4),
        ("train.lr=2", "train", "lr", 2.0),  # an integer for a float field
        ("train.precision=bf16", "train", "precision", "bf16"),  # a bare word is a string
        ('train.precision="bf16"', "train", "precision", "bf16"),  # a TOML string too
        ("data.strict=true", "data", "strict", True),
        ("data.strict=false", "data", "strict", False),
        ("data.num_samples=1_000", "data", "num_samples", 1000),  # TOML integer syntax
        ("parallel.ulysses=auto", "parallel", "ulysses", "auto"),
        ("parallel.ulysses=2", "parallel", "ulysses", 2),
        ("parallel.ring=2", "parallel", "ring", 2),  # a section the file does not have
        ("parallel.backend=gloo", "parallel", "backend", "gloo"),
        ("model.processor=tiny_vl", "model", "processor", "tiny_vl"),
    ],
)
def test_set_overrides(tmp_path, override, section, key, value):
    path = write(tmp_path, """
        [model]
        preset = "qwen2_5_vl_tiny"

        [train]
        max_steps = 40
        lr = 3e-3
    """)
    recipe = Recipe.from_toml(path, overrides=(override,))
    got = getattr(getattr(recipe, section), key)
    assert got == value and type(got) is type(value)
    assert recipe.raw[section][key] == value  # raw keeps the override, as TOML read it
    # Keys not overridden keep the file's values.
    if key != "max_steps":
        assert recipe.train.max_steps == 40


def test_several_overrides_apply_in_order(tmp_path):
    path = write(tmp_path, '[model]\npreset = "qwen2_5_vl_tiny"\n')
    recipe = Recipe.from_toml(
        path, overrides=("train.max_steps=5", "train.max_steps=6", "data.source=jsonl", "data.path=chat.jsonl")
    )
    assert recipe.train.max_steps == 6
    assert (recipe.data.source, recipe.data.path) == ("jsonl", str(pathlib.Path.cwd() / "chat.jsonl"))


def test_set_model_preset_replaces_model_path(tmp_path):
    path = write(tmp_path, '[model]\npath = "/models/Qwen2.5-VL-7B-Instruct"\nprocessor = "tiny_vl"\n')
    recipe = Recipe.from_toml(path, overrides=("model.preset=qwen2_5_vl_tiny",))
    assert recipe.model == ModelSection(preset="qwen2_5_vl_tiny", processor="tiny_vl")
    assert "path" not in recipe.raw["model"]


def test_set_model_path_replaces_model_preset():
    recipe = Recipe.from_toml(TINY_VL, overrides=("model.path=/models/Qwen2.5-VL-7B-Instruct",))
    assert recipe.model == ModelSection(path="/models/Qwen2.5-VL-7B-Instruct")


@pytest.mark.quick
def test_set_paths_that_are_not_relative_to_where_typed(tmp_path, monkeypatch):
    """--set data.path=<stdlib>/... stays the standard library's glob, and --set model.path=org/name a
    Hub id, unless a folder of that name is here (a folder wins, docs/models.md); a plain relative
    path is still taken from the folder typed in."""
    monkeypatch.chdir(tmp_path)
    data: dict = {"model": {"preset": "qwen2_5_vl_tiny"}}
    apply_override(data, "data.path=<stdlib>/email/*.py")
    apply_override(data, "model.path=HuggingFaceTB/SmolLM2-135M-Instruct")
    assert data["data"]["path"] == "<stdlib>/email/*.py"
    assert data["model"] == {"path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    (tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    apply_override(data, "model.path=HuggingFaceTB/SmolLM2-135M-Instruct")
    apply_override(data, "data.path=chat.jsonl")
    assert data["model"]["path"] == str(tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct")
    assert data["data"]["path"] == str(tmp_path / "chat.jsonl")


def test_apply_override_on_raw_data():
    data: dict = {"model": {"preset": "qwen2_5_vl_tiny"}}
    apply_override(data, "train.seed=3")
    apply_override(data, "model.preset=qwen2_text_tiny")
    assert data == {"model": {"preset": "qwen2_text_tiny"}, "train": {"seed": 3}}


def test_set_reaches_the_held_out_data(tmp_path):
    """eval.data.KEY sets one [data] key of the held-out data ([eval.data]), a path relative to the
    folder typed in, the recipe's other [eval.data] keys kept."""
    path = write(tmp_path, """
        [model]
        preset = "qwen2_5_vl_tiny"

        [data]
        source = "jsonl"
        path = "train.jsonl"

        [eval]
        every = 5

        [eval.data]
        num_samples = 7
    """)
    recipe = Recipe.from_toml(path, overrides=("eval.data.path=val.jsonl", "eval.data.strict=true"))
    assert recipe.eval.data.path == str(pathlib.Path.cwd() / "val.jsonl")
    assert recipe.eval.data.strict is True and recipe.eval.data.num_samples == 7
    assert recipe.data.path == "train.jsonl" and recipe.data.strict is False  # [data] untouched


def test_set_onto_a_section_that_is_not_a_table():
    with pytest.raises(RecipeError, match="\\[train\\] is not a table in the recipe"):
        apply_override({"train": 5}, "train.seed=3")


# ---------------------------------------------------------------------------
# raw data
# ---------------------------------------------------------------------------


def test_raw_is_the_merged_data(tmp_path):
    path = write(tmp_path, """
        include = ["rules/modality-groups.toml"]

        [model]
        preset = "qwen2_5_vl_tiny"

        [train]
        max_steps = 40

        [[rules]]
        name = "eager text"
        when = { modality = "text", heads = { ge = 2 } }
        attention = { strategy = "eager" }
    """)
    recipe = Recipe.from_toml(path, overrides=("train.max_steps=3", "parallel.ring=2"))
    assert recipe.raw == {
        "include": ["rules/modality-groups.toml"],
        "model": {"preset": "qwen2_5_vl_tiny"},
        "train": {"max_steps": 3},
        "parallel": {"ring": 2},
        "rules": [
            {"name": "eager text", "when": {"modality": "text", "heads": {"ge": 2}}, "attention": {"strategy": "eager"}}
        ],

    }


def test_raw_is_a_copy():
    data = {"model": {"preset": "qwen2_5_vl_tiny"}, "train": {"max_steps": 4}}
    recipe = Recipe.from_dict(data)
    data["train"]["max_steps"] = 99
    assert recipe.raw["train"]["max_steps"] == 4
    # raw does not take part in equality: two recipes of equal meaning are equal.
    assert recipe == Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "train": {"max_steps": 4}})


def test_paths_given_with_set_are_relative_to_the_current_folder(tmp_path, monkeypatch):
    """In a file, data.path is relative to the file; typed after --set, to where it was typed."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    recipe_file = folder / "r.toml"
    recipe_file.write_text('[model]\npreset = "qwen2_5_vl_tiny"\n[data]\nsource = "jsonl"\npath = "in-file.jsonl"\n')
    monkeypatch.chdir(tmp_path)
    assert Recipe.from_toml(recipe_file).data_file() == folder / "in-file.jsonl"
    typed = Recipe.from_toml(recipe_file, overrides=("data.path=data/typed.jsonl",))
    assert typed.data_file() == tmp_path / "data" / "typed.jsonl"


def test_a_preset_path_is_read_beside_its_recipe(tmp_path, monkeypatch):
    """``preset = "shapes/mine.toml"`` is relative to the recipe's folder, like its other paths,
    whatever the current folder; with --set, to the folder it was typed in."""
    from weft.core.models import model_type_of
    from weft.core.recipe.presets import preset_location

    bundled = importlib.resources.files("weft.recipes") / "presets" / "qwen2_text_tiny.toml"
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "mine.toml").write_text(bundled.read_text())
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text('[model]\npreset = "shapes/mine.toml"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = Recipe.from_toml(recipe_path)
    assert preset_location(recipe) == tmp_path / "shapes" / "mine.toml"
    assert model_type_of(recipe) == "qwen2"
    assert preset_location(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}})) == "qwen2_text_tiny"
    # Given with --set, a path is relative to where it was typed, as data.path and model.path are.
    monkeypatch.chdir(tmp_path)
    typed = Recipe.from_toml(recipe_path, overrides=("model.preset=shapes/mine.toml",))
    assert preset_location(typed) == tmp_path / "shapes" / "mine.toml"


def test_a_warmup_past_the_run_s_steps_is_a_warning(tmp_path, capsys):
    """train.warmup_steps = 1000 with max_steps = 3: the learning rate only ramps up (to 3/1001 of
    train.lr). Not refused (a short trial run keeps its recipe's warmup), but said: one stderr line
    from `weft plan`, which still plans, and the run's schedule.warmup_past_end event; nothing for a
    warmup below the steps, nor under train.epochs before the data counts the steps."""
    import torch

    from model_helpers import ListLog, build_model
    from weft.core.commands.main import main
    from weft.core.context import RunContext
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.train.optimizer_setup import make_optimizer

    path = write(tmp_path, '[model]\npreset = "qwen2_text_tiny"\n[train]\nmax_steps = 3\nwarmup_steps = 1000\n')
    assert main(["plan", str(path), "--json"]) == 0
    err = capsys.readouterr().err
    assert err.count("weft: warning:") == 1 and (
        f"{path} (train.warmup_steps): train.warmup_steps = 1000 is not below the run's 3 steps" in err), err
    assert "0.003 x train.lr at the last step" in err

    recipe = Recipe.from_toml(path)
    model = build_model(recipe)
    pm = build_plugin_manager(entry_points=False)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=1, model=model)
    log = ListLog()
    make_optimizer(recipe, model, plan=plan, pm=pm, ctx=RunContext(recipe=recipe, device=torch.device("cpu"), log=log))
    (event,) = [fields for name, fields in log.events if name == "schedule.warmup_past_end"]
    assert event["warmup_steps"] == 1000 and event["steps"] == 3 and event["last_lr_factor"] == round(3 / 1001, 6)

    assert TrainSection(max_steps=3, warmup_steps=2).warmup_warning() is None
    # The default warmup (2) in a 1-step trial: no one asked for it, so no word.
    assert TrainSection(max_steps=1).warmup_warning() is not None
    trial = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "train": {"max_steps": 1}})
    assert trial.warmup_warning() is None
    assert TrainSection(epochs=1, warmup_steps=1000).warmup_warning() is None  # the steps are not known yet
    assert "the run's 5 steps" in TrainSection(epochs=1, warmup_steps=1000).warmup_warning(steps=5)
