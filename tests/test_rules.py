"""The rule engine: precedence, includes, provenance, selectors, strategy params, Plan JSON.

Hand-made module inventories keep these tests independent of torch and of the model
code. The registry is the built-in plugins' (the bundled defaults name their
strategies) plus a few hand-made ``test_*`` strategies with parameters of every kind.
What the defaults decide is read from defaults.toml, so the tests hold while those
defaults evolve.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
from typing import Literal

import attrs
import pytest

from weft.core.errors import PlanError, RecipeError, WeftError
from weft.core.mesh_spec import MeshSpec
from weft.core.recipe import Recipe
from weft.core.recipe.convert import in_range
from weft.core.recipe.rule_engine import ModuleInfo, Plan, build_plan, matches, validate_rules
from weft.core.recipe.syntax import bundled_path, default_rules
from weft.core.registry import NoParams, Strategy, StrategyRegistry

# ---------------------------------------------------------------------------
# fixtures: a small Qwen2.5-VL-shaped inventory and a registry
# ---------------------------------------------------------------------------

ROOT = ModuleInfo(path="", class_name="Qwen2_5_VLForConditionalGeneration", kind="root")
VISION_BLOCK = ModuleInfo(
    path="model.visual.blocks.0", class_name="Qwen2_5_VLVisionBlock", kind="unit", modality="vision"
)
VISION_ATTN = ModuleInfo(
    path="model.visual.blocks.0.attn", class_name="Qwen2_5_VLVisionAttention", kind="attention",
    modality="vision", heads=16, kv_heads=16, head_dim=80,
)
MERGER = ModuleInfo(path="model.visual.merger", class_name="Qwen2_5_VLPatchMerger", kind="unit", modality="projector")
EMBED = ModuleInfo(path="model.language_model.embed_tokens", class_name="Embedding", kind="unit", modality="embedding")
TEXT_LAYER = ModuleInfo(
    path="model.language_model.layers.0", class_name="Qwen2_5_VLDecoderLayer", kind="unit", modality="text"
)
TEXT_ATTN = ModuleInfo(
    path="model.language_model.layers.0.self_attn", class_name="Qwen2_5_VLAttention", kind="attention",
    modality="text", heads=28, kv_heads=4, head_dim=128,
)
LM_HEAD = ModuleInfo(path="lm_head", class_name="Linear", kind="unit", modality="head")
MODULES = [ROOT, VISION_BLOCK, VISION_ATTN, MERGER, EMBED, TEXT_LAYER, TEXT_ATTN, LM_HEAD]


@attrs.frozen(kw_only=True)
class UlyssesParams:
    backend: Literal["auto", "sdpa", "flash"] = "auto"
    chunks: int = attrs.field(default=1, validator=in_range(low=1))


@attrs.frozen(kw_only=True)
class SpikeParams:
    factor: float = 4.0


#: Hand-made strategies; the "test_" prefix keeps them clear of built-in names.
EXTRA = [
    Strategy(point="attention", name="test_ulysses", params=UlyssesParams),
    Strategy(point="grad_sync", name="test_log_norm"),
    Strategy(point="guard", name="test_loss_spike", params=SpikeParams),
]


def make_registry() -> StrategyRegistry:
    """The built-in plugins' strategies (the defaults name them) plus EXTRA."""
    from weft.core.plugin_manager import build_plugin_manager

    return StrategyRegistry(build_plugin_manager(entry_points=False).registry.all() + EXTRA)


REGISTRY = make_registry()
MODEL = '[model]\npreset = "qwen2_5_vl_tiny"\n'


def write(directory: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def plan_of(recipe: Recipe, *, modules=MODULES, registry=REGISTRY, world_size: int = 8) -> Plan:
    return build_plan(
        recipe=recipe, modules=list(modules), registry=registry, mesh=MeshSpec(dp_shard=world_size),
        world_size=world_size,
    )


def decision(plan: Plan, path: str, point: str):
    module = next(m for m in plan.modules if m.info.path == path)
    found = module.get(point)
    assert found is not None, f"{path or '(root)'} has no {point} decision"
    return found


def rule_header_lines(path: pathlib.Path) -> list[int]:
    return [n for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip().startswith("[[rules]]")]


DEFAULTS = bundled_path("rules/defaults.toml")
MODALITY_GROUPS = bundled_path("rules/modality-groups.toml")


def default_source(point: str, info: ModuleInfo, *, seq_len: int = 2048, world_size: int = 8) -> str:
    """file:line of the default rule that decides ``point`` for ``info``, by a plain scan of defaults.toml."""
    for rule in default_rules():
        if rule.action(point) is not None and matches(rule.when, info, seq_len=seq_len, world_size=world_size):
            return rule.source
    raise AssertionError(f"no default rule decides {point} for {info.path!r}")


# ---------------------------------------------------------------------------
# precedence
# ---------------------------------------------------------------------------


@pytest.mark.quick
def test_recipe_rules_before_includes_before_defaults(tmp_path):
    write(tmp_path, "extra.toml", """
        [[rules]]
        name = "every attention eager"
        attention = { strategy = "eager" }

        [[rules]]
        name = "vision group"
        when = { modality = "vision" }
        shard = { strategy = "fsdp2", group = "vision" }
    """)
    recipe_path = write(tmp_path, "recipe.toml", """
        include = ["extra.toml"]

        [model]
        preset = "qwen2_5_vl_tiny"

        [[rules]]
        name = "text ulysses"
        when = { modality = "text" }
        attention = { strategy = "test_ulysses", chunks = 2 }
    """)
    plan = plan_of(Recipe.from_toml(recipe_path))
    extra = tmp_path / "extra.toml"

    text_attn = decision(plan, TEXT_ATTN.path, "attention")
    assert (text_attn.strategy, text_attn.rule, text_attn.source) == (
        "test_ulysses", "text ulysses", f"{recipe_path}:6",
    )
    assert text_attn.params == UlyssesParams(chunks=2)

    vision_attn = decision(plan, VISION_ATTN.path, "attention")
    assert (vision_attn.strategy, vision_attn.source) == ("eager", f"{extra}:1")

    vision_shard = decision(plan, VISION_BLOCK.path, "shard")
    assert (vision_shard.strategy, vision_shard.params.group, vision_shard.source) == ("fsdp2", "vision", f"{extra}:5")

    # Nothing in the recipe or the include decides these: the defaults do.
    assert decision(plan, TEXT_LAYER.path, "shard").source == default_source("shard", TEXT_LAYER)
    assert decision(plan, TEXT_ATTN.path, "kv_cache").source == default_source("kv_cache", TEXT_ATTN)
    assert plan.decision("batching").source == default_source("batching", ROOT)


@pytest.mark.quick
def test_first_matching_rule_wins_per_point(tmp_path):
    path = write(tmp_path, "recipe.toml", MODEL + """
        [[rules]]
        name = "first"
        when = { modality = "text" }
        attention = { strategy = "test_ulysses" }

        [[rules]]
        name = "second (shadowed for text)"
        attention = { strategy = "eager" }
    """)
    plan = plan_of(Recipe.from_toml(path))
    assert decision(plan, TEXT_ATTN.path, "attention").rule == "first"
    assert decision(plan, VISION_ATTN.path, "attention").rule == "second (shadowed for text)"


@pytest.mark.quick
def test_recipe_rule_beats_an_earlier_listed_include(tmp_path):
    """Precedence is by origin (recipe, includes, defaults), not by where `include` sits."""
    write(tmp_path, "inc.toml", '[[rules]]\nname = "included"\nattention = { strategy = "eager" }\n')
    path = write(
        tmp_path, "recipe.toml",
        'include = ["inc.toml"]\n' + MODEL + '\n[[rules]]\nname = "own"\nattention = { strategy = "sdpa" }\n',
    )
    recipe = Recipe.from_toml(path)
    assert [r.name for r in recipe.rules] == ["own", "included"]
    assert decision(plan_of(recipe), TEXT_ATTN.path, "attention").rule == "own"


@pytest.mark.quick
def test_rule_setting_only_attention_does_not_stop_later_shard_rule(tmp_path):
    path = write(tmp_path, "recipe.toml", MODEL + """
        [[rules]]
        name = "text attention"
        when = { modality = "text" }
        attention = { strategy = "test_ulysses" }

        [[rules]]
        name = "text shard"
        when = { modality = "text" }
        shard = { strategy = "none" }
        attention = { strategy = "eager" }
    """)
    plan = plan_of(Recipe.from_toml(path))
    # The first rule has no `shard`: the second one decides it for the text layer.
    assert decision(plan, TEXT_LAYER.path, "shard").rule == "text shard"
    assert decision(plan, TEXT_LAYER.path, "shard").strategy == "none"
    # ...while attention stays with the first rule.
    assert decision(plan, TEXT_ATTN.path, "attention").rule == "text attention"
    # kv_cache is decided by neither: the default.
    assert decision(plan, TEXT_ATTN.path, "kv_cache").source == default_source("kv_cache", TEXT_ATTN)


@pytest.mark.quick
def test_points_only_apply_to_their_module_kinds(tmp_path):
    path = write(
        tmp_path, "recipe.toml",
        MODEL + '[[rules]]\nattention = { strategy = "eager" }\nshard = { strategy = "none" }\n',
    )
    plan = plan_of(Recipe.from_toml(path))
    by_path = {m.info.path: {d.point for d in m.decisions} for m in plan.modules}
    # adapter decides for every kind of module (a LoRA rule may name any of them).
    assert by_path[""] == {"adapter", "shard", "batching", "objective", "grad_sync", "guard", "optimizer", "metrics"}
    assert by_path[TEXT_ATTN.path] == {"rope", "adapter", "attention", "kv_cache"}
    assert by_path[TEXT_LAYER.path] == {"adapter", "shard", "optimizer"}
    assert [m.info.path for m in plan.modules_for("attention", "eager")] == [VISION_ATTN.path, TEXT_ATTN.path]
    assert len(plan.modules_for("shard", "none")) == 6  # root + five units


@pytest.mark.quick
def test_plan_is_deterministic(tmp_path):
    path = write(tmp_path, "recipe.toml", 'include = ["rules/modality-groups.toml"]\n' + MODEL)
    assert plan_of(Recipe.from_toml(path)) == plan_of(Recipe.from_toml(path))
    assert plan_of(Recipe.from_toml(path)).to_json() == plan_of(Recipe.from_toml(path)).to_json()


# ---------------------------------------------------------------------------
# includes
# ---------------------------------------------------------------------------


@pytest.mark.quick
def test_nested_includes_relative_to_the_including_file(tmp_path):
    write(tmp_path, "recipes/sub/a.toml", """
        include = ["b.toml"]   # next to a.toml, not next to the recipe

        [[rules]]
        name = "a"
        attention = { strategy = "eager" }
    """)
    write(tmp_path, "recipes/sub/b.toml", """
        include = ["../../shared/c.toml", "rules/modality-groups.toml"]

        [[rules]]
        name = "b"
        attention = { strategy = "sdpa" }
    """)
    write(tmp_path, "shared/c.toml", '[[rules]]\nname = "c"\nkv_cache = "dynamic"\n')
    # A decoy b.toml next to the recipe must not be picked up.
    write(tmp_path, "recipes/b.toml", '[[rules]]\nname = "decoy"\nattention = "eager"\n')
    path = write(
        tmp_path, "recipes/recipe.toml",
        'include = ["sub/a.toml"]\n' + MODEL + '\n[[rules]]\nname = "own"\nguard = "finite"\n',
    )

    recipe = Recipe.from_toml(path)
    names = [r.name for r in recipe.rules]
    groups = [
        r.name
        for r in Recipe.from_dict(
            {"model": {"preset": "qwen2_5_vl_tiny"}, "include": ["rules/modality-groups.toml"]}
        ).rules
    ]

    assert names == ["own", "a", "b", "c", *groups]
    sources = [r.source for r in recipe.rules]
    assert sources[:4] == [
        f"{path}:5",
        f"{tmp_path / 'recipes/sub/a.toml'}:3",
        f"{tmp_path / 'recipes/sub/b.toml'}:3",
        f"{tmp_path / 'recipes/sub/../../shared/c.toml'}:1",
    ]
    assert all(s.startswith(f"{MODALITY_GROUPS}:") for s in sources[4:])


@pytest.mark.quick
@pytest.mark.parametrize("name", ["rules/modality-groups.toml", "modality-groups.toml", "modality-groups"])
def test_bundled_rule_files_by_name(tmp_path, name):
    path = write(tmp_path, "recipe.toml", f'include = ["{name}"]\n' + MODEL)
    recipe = Recipe.from_toml(path)
    lines = rule_header_lines(MODALITY_GROUPS)
    assert [r.source for r in recipe.rules] == [f"{MODALITY_GROUPS}:{n}" for n in lines]
    plan = plan_of(recipe)
    vision = decision(plan, VISION_BLOCK.path, "shard")
    assert (vision.params.group, vision.params.reduce_dtype) == ("vision", "float32")
    assert decision(plan, MERGER.path, "shard").params.group == "projector"
    for unit in (EMBED, TEXT_LAYER, LM_HEAD):
        assert decision(plan, unit.path, "shard").params.group == "language"
        assert decision(plan, unit.path, "shard").params.reduce_dtype is None
    # The root has no modality: no modality rule matches it, the default decides.
    assert decision(plan, "", "shard").source == default_source("shard", ROOT)


@pytest.mark.quick
def test_local_file_shadows_bundled_name(tmp_path):
    write(tmp_path, "rules/modality-groups.toml", '[[rules]]\nname = "local copy"\nshard = "none"\n')
    path = write(tmp_path, "recipe.toml", 'include = ["rules/modality-groups.toml"]\n' + MODEL)
    assert [r.name for r in Recipe.from_toml(path).rules] == ["local copy"]


@pytest.mark.quick
def test_include_as_single_string(tmp_path):
    write(tmp_path, "inc.toml", '[[rules]]\nname = "inc"\nshard = "none"\n')
    path = write(tmp_path, "recipe.toml", 'include = "inc.toml"\n' + MODEL)
    assert [r.name for r in Recipe.from_toml(path).rules] == ["inc"]


@pytest.mark.quick
def test_include_cycle_is_rejected(tmp_path):
    write(tmp_path, "a.toml", 'include = ["b.toml"]\n')
    write(tmp_path, "b.toml", 'include = ["./sub/../a.toml"]\n')
    (tmp_path / "sub").mkdir()
    path = write(tmp_path, "recipe.toml", 'include = ["a.toml"]\n' + MODEL)
    with pytest.raises(RecipeError, match="include cycle") as info:
        Recipe.from_toml(path)
    assert "a.toml -> " in str(info.value) and "b.toml" in str(info.value)


@pytest.mark.quick
def test_recipe_including_itself_is_a_cycle(tmp_path):
    path = write(tmp_path, "recipe.toml", 'include = ["recipe.toml"]\n' + MODEL)
    with pytest.raises(RecipeError, match="include cycle"):
        Recipe.from_toml(path)
    # Also when the recipe was named by an absolute path and includes itself relatively.
    with pytest.raises(RecipeError, match="include cycle"):
        Recipe.from_toml(path.resolve())


@pytest.mark.quick
def test_same_file_included_twice_is_not_a_cycle(tmp_path):
    write(tmp_path, "x.toml", '[[rules]]\nname = "x"\nshard = "none"\n')
    write(tmp_path, "a.toml", 'include = ["x.toml"]\n')
    write(tmp_path, "b.toml", 'include = ["x.toml"]\n')
    path = write(tmp_path, "recipe.toml", 'include = ["a.toml", "b.toml"]\n' + MODEL)
    assert [r.name for r in Recipe.from_toml(path).rules] == ["x", "x"]


@pytest.mark.quick
def test_missing_include_names_bundled_files(tmp_path):
    path = write(tmp_path, "recipe.toml", 'include = ["nope.toml"]\n' + MODEL)
    with pytest.raises(RecipeError, match="included file 'nope.toml' not found") as info:
        Recipe.from_toml(path)
    assert "rules/modality-groups.toml" in str(info.value)
    assert str(info.value).startswith(f"{path}:1 (include)")


@pytest.mark.quick
def test_included_file_may_hold_only_rules(tmp_path):
    write(tmp_path, "inc.toml", '[[rules]]\nshard = "none"\n\n[parallel]\nring = 2\n')
    path = write(tmp_path, "recipe.toml", 'include = ["inc.toml"]\n' + MODEL)
    with pytest.raises(RecipeError, match="holds only 'include' and \\[\\[rules\\]\\]; found 'parallel'") as info:
        Recipe.from_toml(path)
    assert str(info.value).startswith(f"{tmp_path / 'inc.toml'}:4")


# ---------------------------------------------------------------------------
# provenance: file:line of the deciding rule's [[rules]] header
# ---------------------------------------------------------------------------


@pytest.mark.quick
def test_provenance_points_at_rules_headers(tmp_path):
    path = write(tmp_path, "recipe.toml", """
        # A recipe with comments, sections between rules and sub-table rules.
        include = ["inc.toml"]

        [model]
        preset = "qwen2_5_vl_tiny"

        [[rules]]   # vision first
        name = "vision"
        when = { modality = "vision" }
        attention = { strategy = "eager" }

        [train]
        max_steps = 3

        [[rules]]
        name = "text"
        [rules.when]
        modality = "text"
        [rules.attention]
        strategy = "test_ulysses"
        backend = "flash"

          [[ rules ]]
        name = "units"
        shard = { strategy = "none" }
    """)
    write(tmp_path, "inc.toml", """
        # included


        [[rules]]
        name = "guard"
        guard = ["finite"]
    """)
    recipe = Recipe.from_toml(path)
    assert [r.source for r in recipe.rules] == [f"{path}:7", f"{path}:15", f"{path}:23", f"{tmp_path / 'inc.toml'}:4"]
    plan = plan_of(recipe)
    assert decision(plan, VISION_ATTN.path, "attention").source == f"{path}:7"
    text_attn = decision(plan, TEXT_ATTN.path, "attention")
    assert text_attn.source == f"{path}:15" and text_attn.params == UlyssesParams(backend="flash")
    assert decision(plan, TEXT_LAYER.path, "shard").source == f"{path}:23"
    assert plan.decisions_of("guard")[0].source == f"{tmp_path / 'inc.toml'}:4"
    assert decision(plan, TEXT_ATTN.path, "kv_cache").source == default_source("kv_cache", TEXT_ATTN)


@pytest.mark.quick
def test_default_rules_provenance():
    lines = rule_header_lines(DEFAULTS)
    rules = default_rules()
    assert [r.source for r in rules] == [f"{DEFAULTS}:{n}" for n in lines]
    plan = plan_of(Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}}))
    for module in plan.modules:
        for d in module.decisions:
            file, _, line = d.source.rpartition(":")
            assert file == str(DEFAULTS) and int(line) in lines
            assert d.source == default_source(d.point, module.info)


@pytest.mark.quick
def test_rules_from_dict_without_text_get_index_sources():
    recipe = Recipe.from_dict(
        {"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"shard": "none"}, {"guard": "finite"}]}
    )
    assert [r.source for r in recipe.rules] == ["<memory>#rule1", "<memory>#rule2"]
    assert [r.name for r in recipe.rules] == ["rule 1", "rule 2"]


# ---------------------------------------------------------------------------
# selectors
# ---------------------------------------------------------------------------


def selector(when: dict):
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"when": when, "attention": "sdpa"}]})
    return recipe.rules[0].when


def hit(when: dict, info: ModuleInfo, *, seq_len: int = 4096, world_size: int = 8) -> bool:
    return matches(selector(when), info, seq_len=seq_len, world_size=world_size)


@pytest.mark.quick
@pytest.mark.parametrize(
    "when, info, expected",
    [
        ({}, ROOT, True),
        ({}, TEXT_ATTN, True),
        # path glob (fnmatch: '*' also crosses dots)
        ({"path": "model.visual.*"}, VISION_ATTN, True),
        ({"path": "model.visual.*"}, TEXT_ATTN, False),
        ({"path": "*.self_attn"}, TEXT_ATTN, True),
        ({"path": "*.layers.[0-3].self_attn"}, TEXT_ATTN, True),
        ({"path": "*.layers.[1-3].self_attn"}, TEXT_ATTN, False),
        ({"path": ["lm_head", "*embed_tokens"]}, EMBED, True),
        ({"path": ["lm_head", "*embed_tokens"]}, TEXT_LAYER, False),
        ({"path": "lm_head"}, LM_HEAD, True),
        ({"path": "LM_HEAD"}, LM_HEAD, False),  # case-sensitive
        ({"path": "*"}, ROOT, True),
        # class glob
        ({"class": "Qwen2_5_VL*Attention"}, VISION_ATTN, True),
        ({"class": "Qwen2_5_VL*Attention"}, TEXT_ATTN, True),
        ({"class": "*Vision*"}, TEXT_ATTN, False),
        ({"class": "Linear"}, LM_HEAD, True),
        ({"class": ["Embedding", "Linear"]}, EMBED, True),
        # modality, single and list
        ({"modality": "text"}, TEXT_ATTN, True),
        ({"modality": "text"}, TEXT_LAYER, True),
        ({"modality": "text"}, VISION_ATTN, False),
        ({"modality": ["vision", "projector"]}, MERGER, True),
        ({"modality": ["vision", "projector"]}, EMBED, False),
        ({"modality": "head"}, LM_HEAD, True),
        ({"modality": "vision"}, ROOT, False),  # the root has no modality
        # numbers: plain integer = equality
        ({"heads": 28}, TEXT_ATTN, True),
        ({"heads": 16}, TEXT_ATTN, False),
        ({"kv_heads": 4}, TEXT_ATTN, True),
        ({"head_dim": 80}, VISION_ATTN, True),
        ({"head_dim": 80}, TEXT_ATTN, False),
        ({"kv_heads": {"lt": 8}}, TEXT_ATTN, True),
        ({"kv_heads": {"lt": 8}}, VISION_ATTN, False),
        ({"heads": {"gt": 4, "le": 28}}, TEXT_ATTN, True),  # range: every comparison must hold
        ({"heads": {"gt": 4, "lt": 28}}, TEXT_ATTN, False),
        # a numeric selector on a module without that number never matches
        ({"heads": {"ge": 0}}, TEXT_LAYER, False),
        ({"heads": {"ne": 5}}, ROOT, False),
        ({"head_dim": 128}, LM_HEAD, False),
        ({"kv_heads": {"le": 1000}}, MERGER, False),
        # AND of several selectors
        ({"modality": "text", "heads": 28, "path": "*layers.0*", "class": "*Attention"}, TEXT_ATTN, True),
        ({"modality": "text", "heads": 28, "path": "*layers.1*"}, TEXT_ATTN, False),
        ({"modality": "vision", "heads": 28}, TEXT_ATTN, False),
        ({"modality": "text", "class": "*Vision*"}, TEXT_ATTN, False),
        ({"modality": "text", "world_size": {"ge": 16}}, TEXT_ATTN, False),
    ],
)
def test_selector(when, info, expected):
    assert hit(when, info) is expected


@pytest.mark.quick
@pytest.mark.parametrize(
    "op, value, expected",
    [
        ("eq", 28, True), ("eq", 27, False),
        ("ne", 28, False), ("ne", 27, True),
        ("gt", 27, True), ("gt", 28, False),
        ("ge", 28, True), ("ge", 29, False),
        ("lt", 29, True), ("lt", 28, False),
        ("le", 28, True), ("le", 27, False),
    ],
)
@pytest.mark.parametrize("key", ["heads", "kv_heads", "head_dim", "seq_len", "world_size"])
def test_numeric_comparisons(key, op, value, expected):
    # Every numeric selector compares one number; give that number 28 in each.
    info = attrs.evolve(TEXT_ATTN, heads=28, kv_heads=28, head_dim=28)
    assert hit({key: {op: value}}, info, seq_len=28, world_size=28) is expected


@pytest.mark.quick
def test_seq_len_selector_reads_train_seq_len():
    rules = [{"when": {"modality": "text", "seq_len": {"gt": 65536}}, "attention": {"strategy": "test_ulysses"}}]
    long = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "train": {"max_seq_len": 131072}, "rules": rules})
    short = Recipe.from_dict(
        {"model": {"preset": "qwen2_5_vl_tiny"}, "train": {"micro_batch_tokens": 65536}, "rules": rules}
    )
    assert decision(plan_of(long), TEXT_ATTN.path, "attention").strategy == "test_ulysses"
    assert plan_of(long).seq_len == 131072
    # max_seq_len = 0: the seq_len selector sees micro_batch_tokens, and the rule does not match.
    assert decision(plan_of(short), TEXT_ATTN.path, "attention").source == default_source(
        "attention", TEXT_ATTN, seq_len=65536
    )
    assert plan_of(short).seq_len == 65536


@pytest.mark.quick
def test_world_size_selector_reads_the_planned_world_size():
    recipe = Recipe.from_dict({
        "model": {"preset": "qwen2_5_vl_tiny"},
        "rules": [{"when": {"world_size": {"ge": 4}}, "shard": "fsdp2"}, {"shard": "none"}],
    })
    assert decision(plan_of(recipe, world_size=4), TEXT_LAYER.path, "shard").strategy == "fsdp2"
    assert decision(plan_of(recipe, world_size=2), TEXT_LAYER.path, "shard").strategy == "none"
    assert plan_of(recipe, world_size=2).world_size == 2


@pytest.mark.quick
@pytest.mark.parametrize(
    "when, message",
    [
        ({"modalty": "text"}, "unknown selector 'modalty'; did you mean 'modality'?"),
        ({"modality": "txt"}, "unknown modality 'txt'; did you mean 'text'?"),
        ({"modality": ["text", 3]}, "selector 'modality' must be a string or a list of strings"),
        ({"class": {"glob": "x"}}, "selector 'class' must be a string or a list of strings"),
        ({"heads": {">=": 4}}, "unknown comparison '>='; did you mean 'ge'?"),
        ({"heads": {"lte": 4}}, "unknown comparison 'lte'; did you mean 'le'?"),
        ({"heads": {"ge": 4.0}}, "comparison ge needs an integer, got 4.0"),
        ({"heads": {"ge": True}}, "comparison ge needs an integer, got True"),
        ({"heads": True}, "a numeric selector takes an integer or a table of comparisons"),
        ({"seq_len": {}}, "a numeric selector takes an integer or a table of comparisons"),
        ({"world_size": [2, 4]}, "a numeric selector takes an integer or a table of comparisons"),
    ],
)
def test_bad_selectors(when, message):
    with pytest.raises(RecipeError) as info:
        selector(when)
    assert message in str(info.value)


@pytest.mark.quick
def test_when_must_be_a_table():
    with pytest.raises(RecipeError, match="'when' must be a table of selectors"):
        selector("vision")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# strategies and their parameters
# ---------------------------------------------------------------------------


def recipe_with(rule_text: str, tmp_path: pathlib.Path) -> tuple[Recipe, pathlib.Path]:
    path = write(tmp_path, "recipe.toml", MODEL + "\n" + textwrap.dedent(rule_text).lstrip("\n"))
    return Recipe.from_toml(path), path


@pytest.mark.quick
def test_unknown_strategy_lists_the_available_ones(tmp_path):
    recipe, path = recipe_with(
        '[[rules]]\nwhen = { modality = "text" }\nattention = { strategy = "test_ulyses" }\n', tmp_path
    )
    with pytest.raises(RecipeError) as info:
        plan_of(recipe)
    available = ", ".join(REGISTRY.names("attention"))
    assert "test_ulysses" in available and "sdpa" in available
    assert str(info.value) == (
        f"{path}:4 (attention.strategy): unknown attention strategy 'test_ulyses'; did you mean 'test_ulysses'? "
        f"Available: {available}"
    )


@pytest.mark.quick
def test_unknown_strategy_without_close_match(tmp_path):
    recipe, _ = recipe_with('[[rules]]\nkv_cache = "zzzz"\n', tmp_path)
    with pytest.raises(RecipeError) as info:
        plan_of(recipe)
    assert str(info.value).endswith(
        f"unknown kv_cache strategy 'zzzz'. Available: {', '.join(REGISTRY.names('kv_cache'))}"
    )


@pytest.mark.quick
def test_strategy_of_another_point_is_unknown(tmp_path):
    recipe, _ = recipe_with('[[rules]]\nshard = "test_ulysses"\n', tmp_path)
    with pytest.raises(RecipeError) as info:
        plan_of(recipe)
    assert "unknown shard strategy 'test_ulysses'" in str(info.value)
    assert str(info.value).endswith(f"Available: {', '.join(REGISTRY.names('shard'))}")


@pytest.mark.quick
def test_unknown_param_key(tmp_path):
    recipe, path = recipe_with('[[rules]]\nattention = { strategy = "test_ulysses", chunk = 2 }\n', tmp_path)
    with pytest.raises(RecipeError) as info:
        plan_of(recipe)
    assert str(info.value).startswith(f"{path}:4 (attention.chunk): unknown key 'chunk'; did you mean 'chunks'?")
    assert "Accepted keys here: backend, chunks" in str(info.value)


@pytest.mark.quick
def test_param_for_a_strategy_without_params(tmp_path):
    recipe, _ = recipe_with('[[rules]]\ngrad_sync = { strategy = "test_log_norm", backend = "flash" }\n', tmp_path)
    with pytest.raises(
        RecipeError, match=r"\(grad_sync.backend\): unknown key 'backend'\. Accepted keys here: \(no keys\)"
    ):
        plan_of(recipe)


@pytest.mark.quick
@pytest.mark.parametrize(
    "params, message",
    [
        ('chunks = "2"', "'2' (string) is not accepted for 'chunks'; expected an integer"),
        ("chunks = 2.5", "2.5 (number) is not accepted for 'chunks'; expected an integer"),
        ("chunks = true", "True (boolean) is not accepted for 'chunks'; expected an integer"),
        ("chunks = 0", "chunks = 0 is out of range; accepted: >= 1"),
        ('backend = "flash2"', "expected one of 'auto', 'sdpa', 'flash'; did you mean 'flash'?"),
        ('backend = ["flash"]', "['flash'] (list) is not accepted for 'backend'"),
    ],
)
def test_param_wrong_type_or_value(tmp_path, params, message):
    recipe, path = recipe_with(f'[[rules]]\nattention = {{ strategy = "test_ulysses", {params} }}\n', tmp_path)
    with pytest.raises(RecipeError) as info:
        plan_of(recipe)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}:4 (attention")


@pytest.mark.quick
def test_params_are_checked_even_when_no_module_matches(tmp_path):
    recipe, _ = recipe_with(
        '[[rules]]\nwhen = { path = "no.such.module" }\nshard = { strategy = "fsdp2", grop = "x" }\n', tmp_path
    )
    with pytest.raises(RecipeError, match="unknown key 'grop'; did you mean 'group'?"):
        plan_of(recipe)
    with pytest.raises(RecipeError, match="unknown key 'grop'"):
        validate_rules(recipe.rules, REGISTRY)


@pytest.mark.quick
def test_int_param_for_float_field_is_converted(tmp_path):
    recipe, _ = recipe_with('[[rules]]\ngrad_sync = { strategy = "clip", max_norm = 2 }\n', tmp_path)
    (clip,) = plan_of(recipe).decisions_of("grad_sync")
    assert clip.params.max_norm == 2.0 and isinstance(clip.params.max_norm, float)


@pytest.mark.quick
def test_guard_and_grad_sync_accept_lists(tmp_path):
    recipe, path = recipe_with("""
        [[rules]]
        name = "watch"
        grad_sync = [{ strategy = "clip", max_norm = 0.5 }, { strategy = "test_log_norm" }]
        guard = ["finite", { strategy = "test_loss_spike", factor = 3.0 }]
    """, tmp_path)
    plan = plan_of(recipe)
    clip, log_norm = plan.decisions_of("grad_sync")
    assert (clip.strategy, clip.params.max_norm, log_norm.strategy, log_norm.params) == (
        "clip", 0.5, "test_log_norm", NoParams(),
    )
    finite, spike = plan.decisions_of("guard")
    assert (finite.strategy, spike.strategy, spike.params) == ("finite", "test_loss_spike", SpikeParams(factor=3.0))
    # The whole list comes from the first matching rule: the default's guard is not added.
    assert {d.source for d in plan.decisions_of("guard")} == {f"{path}:4"}
    decisions = plan.to_json()["modules"][0]["decisions"]
    assert set(decisions) == {
        "adapter", "shard", "batching", "objective", "grad_sync.clip", "grad_sync.test_log_norm", "guard.finite",
        "guard.test_loss_spike",
        "optimizer", "metrics.jsonl",
    }
    assert decisions["guard.test_loss_spike"]["params"] == {"factor": 3.0}


@pytest.mark.quick
def test_list_param_errors_name_the_point(tmp_path):
    recipe, _ = recipe_with('[[rules]]\nguard = ["finite", { strategy = "test_loss_spike", factr = 3.0 }]\n', tmp_path)
    with pytest.raises(RecipeError, match="\\(guard.factr\\): unknown key 'factr'; did you mean 'factor'?"):
        plan_of(recipe)


@pytest.mark.quick
@pytest.mark.parametrize("point", ["shard", "attention", "kv_cache", "batching"])
def test_single_points_refuse_lists(point):
    with pytest.raises(RecipeError, match=f"{point} must be a table with a 'strategy' string"):
        Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{point: ["a", "b"]}]})


@pytest.mark.quick
@pytest.mark.parametrize("value", [{"max_norm": 1.0}, 3, [{"strategy": "clip"}, 5], {"strategy": 1}])
def test_action_needs_a_strategy_string(value):
    with pytest.raises(RecipeError, match="grad_sync must be a table with a 'strategy' string .* or a list of them"):
        Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"grad_sync": value}]})


@pytest.mark.quick
def test_unknown_hook_point_did_you_mean():
    with pytest.raises(RecipeError, match="unknown rule key 'gaurd'; did you mean 'guard'?"):
        Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"gaurd": "finite"}]})


@pytest.mark.quick
def test_rule_choosing_nothing():
    with pytest.raises(RecipeError, match="a rule must choose a strategy for at least one hook point"):
        Recipe.from_dict(
            {"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"name": "empty", "when": {"modality": "text"}}]}
        )


@pytest.mark.quick
def test_duplicate_strategy_declaration_is_refused():
    with pytest.raises(PlanError, match="declared twice: by plugin 'a' and by plugin 'b'"):
        StrategyRegistry([Strategy(point="shard", name="x", plugin="a"), Strategy(point="shard", name="x", plugin="b")])


@pytest.mark.quick
def test_a_resolving_strategy_is_replaced_in_the_plan_by_a_registered_one():
    """A strategy's ``resolve`` runs once per module when the Plan is built: the decision names
    what it returned (the rule's strategy kept in ``resolved_from``); a name nobody declared is
    a plan error naming the module and the plugin."""
    def to(name):
        return Strategy(point="attention", name=f"test_to_{name}", plugin="test-plugin",
                        resolve=lambda params, *, info, plan: (name, NoParams()) if info.modality == "text" else None)

    registry = StrategyRegistry(REGISTRY.all() + [to("sdpa"), to("nope")])
    plan = plan_of(Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"attention": "test_to_sdpa"}]}),
                   registry=registry)
    text, vision = decision(plan, TEXT_ATTN.path, "attention"), decision(plan, VISION_ATTN.path, "attention")
    assert (text.strategy, text.resolved_from, vision.strategy, vision.resolved_from) == (
        "sdpa", "test_to_sdpa", "test_to_sdpa", "")
    with pytest.raises(PlanError, match=r"layers\.0\.self_attn: attention strategy 'test_to_nope' \(plugin "
                                        r"'test-plugin'\) resolved to 'nope' with NoParams, which is not a registered"):
        plan_of(Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"attention": "test_to_nope"}]}),
                registry=registry)


@pytest.mark.quick
def test_builtin_registry_plans_with_defaults(tmp_path):
    """The built-in plugins alone carry out every default and bundled rule."""
    from weft.core.plugin_manager import build_plugin_manager

    registry = build_plugin_manager(entry_points=False).registry
    recipe = Recipe.from_toml(write(tmp_path, "recipe.toml", 'include = ["rules/modality-groups.toml"]\n' + MODEL))
    plan = plan_of(recipe, registry=registry)
    for module in plan.modules:
        for d in module.decisions:
            assert isinstance(d.params, registry.get(d.point, d.strategy).params)
            if not d.source.startswith(f"{MODALITY_GROUPS}:"):
                assert d.source == default_source(d.point, module.info)
    assert decision(plan, VISION_BLOCK.path, "shard").params.reduce_dtype == "float32"
    assert decision(plan, TEXT_LAYER.path, "shard").params.group == "language"
    assert plan.decision("batching").point == "batching"
    assert plan.decisions_of("grad_sync") and plan.decisions_of("guard")
    json.dumps(plan.to_json())  # every built-in params class serialises
    bad = Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{"attention": "nope"}]})
    with pytest.raises(RecipeError) as info:
        plan_of(bad, registry=registry)
    assert f"Available: {', '.join(registry.names('attention'))}" in str(info.value)


# ---------------------------------------------------------------------------
# Plan JSON
# ---------------------------------------------------------------------------


@pytest.mark.quick
def test_plan_to_json_round_trip_shape(tmp_path):
    path = write(
        tmp_path, "recipe.toml",
        MODEL + '\n[[rules]]\nname = "text"\nwhen = { modality = "text" }\n'
        'attention = { strategy = "test_ulysses", chunks = 2 }\n',
    )
    plan = build_plan(
        recipe=Recipe.from_toml(path), modules=MODULES, registry=REGISTRY,
        mesh=MeshSpec(dp_replicate=2, dp_shard=2, ulysses=2, ring=1), world_size=8,
    )
    data = plan.to_json()
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {"world_size", "seq_len", "mesh", "modules"}
    assert data["world_size"] == 8 and data["seq_len"] == 2048
    assert data["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "ulysses": 2, "ring": 1}
    assert [m["path"] for m in data["modules"]] == [m.path for m in MODULES]
    for module, info in zip(data["modules"], MODULES):
        assert set(module) == {"path", "class", "kind", "modality", "heads", "kv_heads", "head_dim", "decisions"}
        assert (
            module["class"], module["kind"], module["modality"], module["heads"], module["kv_heads"], module["head_dim"]
        ) == (info.class_name, info.kind, info.modality, info.heads, info.kv_heads, info.head_dim)
        for d in module["decisions"].values():
            # "resolved_from" only where the Plan resolved the rule's strategy (attention 'auto').
            assert set(d) - {"resolved_from"} == {"strategy", "params", "rule", "source"}
            assert isinstance(d["params"], dict)
    vision = data["modules"][MODULES.index(VISION_ATTN)]["decisions"]["attention"]
    assert vision["resolved_from"] == "auto" and vision["strategy"] in ("sdpa", "vision_local")
    text = data["modules"][MODULES.index(TEXT_ATTN)]["decisions"]
    assert text["attention"] == {
        "strategy": "test_ulysses", "params": {"backend": "auto", "chunks": 2}, "rule": "text", "source": f"{path}:4",
    }

    assert text["kv_cache"]["source"] == default_source("kv_cache", TEXT_ATTN)
    root = data["modules"][0]["decisions"]
    # Collect-all points are keyed "point.strategy", the others by the point alone.
    assert {"shard", "batching"} <= set(root)
    assert {k.split(".")[0] for k in root} == {"adapter", "shard", "batching", "objective", "grad_sync", "guard",
                                               "optimizer", "metrics"}
    assert all(k.count(".") == 1 for k in root if k.startswith(("grad_sync", "guard")))


# ---------------------------------------------------------------------------
# purity: the planning core imports no torch
# ---------------------------------------------------------------------------


def test_core_modules_import_without_torch():
    code = (
        "import sys\n"
        "import weft.core.recipe.rule_engine, weft.core.recipe, weft.core.recipe.convert, weft.core.mesh_spec\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
        "from weft.core.recipe import Recipe\n"
        "Recipe.from_dict({'model': {'preset': 'qwen2_5_vl_tiny'}, 'include': ['rules/modality-groups.toml']})\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.quick
def test_errors_are_weft_errors():
    assert issubclass(RecipeError, WeftError) and issubclass(PlanError, WeftError)
    assert RecipeError("x", where="f.toml:3").exit_code == 2
    assert str(RecipeError("bad", where="f.toml:3 (train)")) == "f.toml:3 (train): bad"


@pytest.mark.quick
@pytest.mark.parametrize("point", ["grad_sync", "guard"])
def test_empty_strategy_list_is_refused(point):
    # An empty list would silently drop the point (for grad_sync: no gradient reduction at all).
    with pytest.raises(RecipeError, match=f"{point} = \\[\\] chooses no strategy"):
        Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "rules": [{point: []}]})
