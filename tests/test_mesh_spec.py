"""resolve_mesh: filling dp_shard = -1, ulysses = "auto", and the product check."""

from __future__ import annotations

import pytest

from weft.core.errors import PlanError, RecipeError
from weft.core.mesh_spec import MESH_ORDER, MeshSpec, resolve_mesh
from weft.core.recipe import ParallelSection, Recipe

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)

WHERE = "recipe.toml [parallel]"


def resolve(world_size: int, heads: int | None = 28, **parallel) -> MeshSpec:
    return resolve_mesh(ParallelSection(**parallel), world_size=world_size, heads=heads, where=WHERE)


def test_dims_are_outermost_first():
    assert MESH_ORDER == ("dp_replicate", "dp_shard", "ring", "ulysses")  # the live mesh's order too
    spec = MeshSpec(dp_replicate=2, dp_shard=3, ulysses=4, ring=5)
    assert spec.shape == (2, 3, 5, 4)
    assert spec.world_size == 120 and spec.sp == 20 and spec.dp == 6


@pytest.mark.parametrize(
    "world_size, parallel, expected",
    [
        (1, {}, (1, 1, 1, 1)),
        (8, {}, (1, 8, 1, 1)),
        (8, {"dp_replicate": 2}, (2, 4, 1, 1)),
        (8, {"ring": 2}, (1, 4, 2, 1)),
        (16, {"dp_replicate": 2, "ulysses": 2, "ring": 2}, (2, 2, 2, 2)),
        (8, {"dp_replicate": 2, "ulysses": 4}, (2, 1, 1, 4)),
        (8, {"dp_shard": 8}, (1, 8, 1, 1)),  # explicit and matching
    ],
)
def test_dp_shard_fill(world_size, parallel, expected):
    assert resolve(world_size, **parallel).shape == expected


@pytest.mark.parametrize(
    "world_size, heads, parallel, expected_ulysses, expected_dp_shard",
    [
        (8, 28, {}, 4, 2),  # divisors of 8 that divide 28: 1, 2, 4
        (8, 32, {}, 8, 1),
        (8, 4, {}, 4, 2),  # the tiny preset: 4 text query heads
        (3, 4, {}, 1, 3),  # 3 does not divide 4: no Ulysses, all data parallel
        (6, 4, {}, 2, 3),
        (16, 12, {"ring": 2}, 4, 2),  # room after ring = 8; 12 allows 4
        (8, 28, {"dp_shard": 2}, 4, 2),  # a fixed dp_shard leaves room 4
        (8, 28, {"dp_shard": 4}, 2, 4),
        (8, 28, {"dp_replicate": 2, "dp_shard": 2}, 2, 2),
        (8, None, {}, 1, 8),  # no text heads known: no Ulysses
        (7, 28, {}, 7, 1),
        (5, 28, {}, 1, 5),
    ],
)
def test_ulysses_auto(world_size, heads, parallel, expected_ulysses, expected_dp_shard):
    spec = resolve(world_size, heads, ulysses="auto", **parallel)
    assert (spec.ulysses, spec.dp_shard) == (expected_ulysses, expected_dp_shard)
    assert spec.world_size == world_size


def test_ulysses_auto_is_the_largest_degree_allowed():
    for world_size in range(1, 33):
        for heads in (1, 2, 3, 4, 6, 8, 12, 16, 28, 64):
            spec = resolve(world_size, heads, ulysses="auto")
            allowed = [d for d in range(1, world_size + 1) if world_size % d == 0 and heads % d == 0]
            assert spec.ulysses == max(allowed), (world_size, heads)
            assert spec.world_size == world_size


def test_product_mismatch_lists_every_factor():
    with pytest.raises(PlanError) as info:
        resolve(4, dp_shard=2, ulysses=2, ring=2)
    assert str(info.value) == f"{WHERE}: dp_replicate(1) * dp_shard(2) * ring(2) * ulysses(2) = 8 != world_size(4)"


def test_product_mismatch_too_small():
    with pytest.raises(PlanError, match=r"dp_replicate\(2\) \* dp_shard\(1\) \* ring\(1\) \* ulysses\(1\) "
                                        r"= 2 != world_size\(8\)"):
        resolve(8, dp_replicate=2, dp_shard=1)


def test_ulysses_auto_with_fixed_dims_not_dividing_world_size():
    # dp_replicate * ring * dp_shard = 3 does not divide 8: auto falls back to 1 and the product check speaks.
    with pytest.raises(PlanError, match=r"dp_replicate\(1\) \* dp_shard\(3\) \* ring\(1\) \* ulysses\(1\) "
                                        r"= 3 != world_size\(8\)"):
        resolve(8, dp_shard=3, ulysses="auto")


def test_fill_that_does_not_divide():
    with pytest.raises(PlanError) as info:
        resolve(4, ring=3)
    assert str(info.value) == (
        f"{WHERE}: dp_replicate(1) * ulysses(1) * ring(3) = 3 does not divide world_size(4), "
        "so parallel.dp_shard = -1 cannot fill it"
    )


def test_world_size_must_be_positive():
    with pytest.raises(PlanError, match="world size must be >= 1, got 0"):
        resolve(0)


@pytest.mark.parametrize(
    "parallel, message",
    [
        ({"dp_shard": 0}, "parallel.dp_shard = 0 is not accepted; use a positive degree or -1 (fill)"),
        ({"dp_shard": -3}, "dp_shard = -3 is out of range; accepted: >= -1"),
        ({"ulysses": 0}, "parallel.ulysses = 0 is out of range; accepted: >= 1 or 'auto'"),
        ({"ring": 0}, "ring = 0 is out of range; accepted: >= 1"),
        ({"dp_replicate": 0}, "dp_replicate = 0 is out of range; accepted: >= 1"),
        ({"ulysses": "max"}, "'max' (string) is not accepted for 'ulysses'; expected an integer or one of 'auto'"),
        ({"ulysses": "Auto"}, "did you mean 'auto'?"),
    ],
)
def test_bad_parallel_values(parallel, message):
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}, "parallel": parallel})
    assert message in str(info.value)
