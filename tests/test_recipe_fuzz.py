"""Fuzz: whatever TOML-shaped data a recipe holds, parsing fails only with a WeftError.

Random tables mix the real section, key, rule, selector and strategy names with junk
keys and values of every TOML type (no None: TOML has none). A recipe that parses is
then planned against a small registry, which must also fail only with a WeftError.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weft.core.errors import WeftError
from weft.core.hookspecs import HOOK_POINTS
from weft.core.mesh_spec import MeshSpec
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import DataSection, ModelSection, ParallelSection, Recipe, TrainSection, apply_override
from weft.core.recipe.rule_engine import ModuleInfo, build_plan
from weft.core.recipe.syntax import COMPARISONS, MODALITIES, SELECTOR_KEYS

SECTIONS = {"model": ModelSection, "data": DataSection, "train": TrainSection, "parallel": ParallelSection}
FIELDS = sorted({f.name for cls in SECTIONS.values() for f in attrs.fields(cls)})
REAL_KEYS = sorted(
    {*SECTIONS, "include", "rules", "name", "when", "strategy", *HOOK_POINTS, *SELECTOR_KEYS, *COMPARISONS, *FIELDS}
)
WORDS = [
    "qwen2_5_vl_tiny", "auto", "fsdp2", "sdpa", "eager", "finite", "clip", "dynamic", "token_budget", "none",
    "synthetic", "jsonl", "bf16", "fp32", "gloo", "cpu", "float32", "rules/modality-groups.toml", "nope.toml",
    *MODALITIES,
]

#: The built-in plugins' strategies: the defaults name them. Building it imports no torch.
REGISTRY = build_plugin_manager(entry_points=False).registry

keys = st.one_of(st.sampled_from(REAL_KEYS), st.text(min_size=1, max_size=10))
scalars = st.one_of(
    st.sampled_from(WORDS),
    st.text(max_size=16),
    st.integers(min_value=-3, max_value=70000),
    st.integers(),  # also far outside 64 bits: tomllib reads any size
    st.floats(),  # nan and inf are TOML too
    st.booleans(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=8,
)


def section(name: str):
    names = [f.name for f in attrs.fields(SECTIONS[name])]
    return st.one_of(
        st.dictionaries(st.one_of(st.sampled_from(names), keys), values, max_size=4),
        values,
    )


selectors = st.one_of(
    st.dictionaries(
        st.one_of(st.sampled_from(SELECTOR_KEYS), keys),
        st.one_of(
            values,
            st.sampled_from(MODALITIES),
            st.lists(st.sampled_from(MODALITIES), max_size=3),
            st.dictionaries(
                st.one_of(st.sampled_from(COMPARISONS), keys), st.one_of(st.integers(-2, 100), values), max_size=3
            ),
        ),
        max_size=3,
    ),
    values,
)
actions = st.one_of(
    st.sampled_from(WORDS),
    st.fixed_dictionaries(
        {"strategy": st.one_of(st.sampled_from(WORDS), values)},
        optional={"group": values, "max_norm": values, "junk": values},
    ),
    st.lists(
        st.one_of(st.sampled_from(WORDS), st.fixed_dictionaries({"strategy": st.sampled_from(WORDS)})), max_size=3
    ),
    values,
)
rules = st.dictionaries(
    st.one_of(st.sampled_from(["name", "when", *HOOK_POINTS]), keys),
    st.one_of(actions, selectors, values),
    max_size=4,
)


def plausible_value(field: attrs.Attribute):
    """Mostly the field's own type, sometimes a neighbour's: many such recipes parse."""
    kind = type(field.default)
    own = {
        int: st.integers(min_value=-2, max_value=5000),
        float: st.floats(min_value=-0.5, max_value=2.0),
        bool: st.booleans(),
    }.get(kind, st.sampled_from(WORDS))
    return st.one_of(own, own, own, scalars)


def plausible_section(name: str):
    fields = [f for f in attrs.fields(SECTIONS[name]) if f.name not in ("path", "preset")]
    return st.lists(st.sampled_from(fields), max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({f.name: plausible_value(f) for f in chosen})
    )


NAMES = {point: REGISTRY.names(point) or ["none"] for point in HOOK_POINTS}
plausible_rules = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.text(max_size=8),
            "when": st.fixed_dictionaries(
                {},
                optional={
                    "modality": st.one_of(
                        st.sampled_from(MODALITIES), st.lists(st.sampled_from(MODALITIES), max_size=2)
                    ),
                    "path": st.sampled_from(["*", "model.*", "*attn", ["lm_head", "*layers*"]]),
                    "heads": st.one_of(
                        st.integers(0, 8),
                        st.dictionaries(st.sampled_from(COMPARISONS), st.integers(0, 8), min_size=1, max_size=2),
                    ),
                    "seq_len": st.dictionaries(
                        st.sampled_from(COMPARISONS), st.integers(0, 5000), min_size=1, max_size=2
                    ),
                },
            ),
            **{
                point: st.one_of(
                    st.sampled_from(names),
                    st.fixed_dictionaries(
                        {"strategy": st.sampled_from(names)},
                        optional={
                            "group": st.sampled_from(["v", 1]),
                            "max_norm": st.sampled_from([0.5, 2, "x", -1.0, float("nan")]),
                        },
                    ),
                )
                for point, names in NAMES.items()
            },
        },
    ),
    max_size=3,
)
plausible = st.fixed_dictionaries(
    {"model": st.just({"preset": "qwen2_5_vl_tiny"})},
    optional={
        "data": plausible_section("data"),
        "train": plausible_section("train"),
        "parallel": plausible_section("parallel"),
        "rules": plausible_rules,
        "include": st.lists(st.sampled_from(["rules/modality-groups.toml", "modality-groups"]), max_size=2),
    },
)
recipes = st.one_of(
    plausible,
    st.fixed_dictionaries(
        {},
        optional={
            "model": st.one_of(
                st.fixed_dictionaries(
                    {"preset": st.one_of(st.just("qwen2_5_vl_tiny"), values)},
                    optional={"path": values, "processor": values},
                ),
                section("model"),
            ),
            "data": section("data"),
            "train": section("train"),
            "parallel": section("parallel"),
            "rules": st.one_of(st.lists(st.one_of(rules, values), max_size=3), values),
            "include": st.one_of(
                st.lists(st.sampled_from(["rules/modality-groups.toml", "modality-groups", "nope.toml"]), max_size=2),
                values,
            ),
            "junk": values,
        },
    ),
    st.dictionaries(keys, values, max_size=5),
)

MODULES = [
    ModuleInfo(path="", class_name="Model", kind="root"),
    ModuleInfo(path="model.visual.blocks.0", class_name="Block", kind="unit", modality="vision"),
    ModuleInfo(path="model.layers.0", class_name="Layer", kind="unit", modality="text"),
    ModuleInfo(
        path="model.layers.0.self_attn",
        class_name="Attention",
        kind="attention",
        modality="text",
        heads=4,
        kv_heads=2,
        head_dim=16,
    ),
]


FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@FUZZ
@given(data=recipes)
def test_from_dict_raises_only_weft_errors(data):
    try:
        recipe = Recipe.from_dict(data)
    except WeftError:
        return
    try:
        build_plan(recipe=recipe, modules=MODULES, registry=REGISTRY, mesh=MeshSpec(), world_size=1)
    except WeftError:
        pass


@pytest.mark.quick
@FUZZ
@given(
    data=st.dictionaries(
        st.sampled_from([*SECTIONS, "rules"]), st.one_of(st.dictionaries(keys, values, max_size=3), values), max_size=3
    ),
    key=st.one_of(
        st.builds(
            lambda s, k: f"{s}.{k}",
            st.sampled_from([*SECTIONS, "trian"]),
            st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)),
        ),
        st.text(max_size=20),
    ),
    sep=st.sampled_from(["=", " = ", "", "=="]),
    value=st.one_of(
        st.sampled_from([
            "10", "1e-3", "true", "auto", "bf16", '"x"', "[1, 2]", "{ a = 1 }", "", "[[[", "nan", "inf",
            "99999999999999999999999",
        ]),

        st.text(max_size=20),
    ),
)
def test_set_overrides_raise_only_weft_errors(data, key, sep, value):
    override = f"{key}{sep}{value}"
    try:
        apply_override(data, override)
    except WeftError:
        return
    data.setdefault("model", {"preset": "qwen2_5_vl_tiny"})
    try:
        Recipe.from_dict(data, overridden={key.strip(): override})
    except WeftError:
        pass
