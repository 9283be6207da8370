"""Token-budget batching: deterministic by seed, disjoint across DP ranks, resumable mid-epoch."""

from __future__ import annotations

import pytest
import structlog
import torch

from weft.core.context import RunContext, RunState
from weft.core.plan.planner import plan_recipe
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import Recipe
from weft.strategies.data.token_budget import pack_micro_batches, schedule_steps

pytestmark = pytest.mark.quick  # every test here: the quick tier (DEVELOPERS.md)


class FakeMesh:
    def __init__(self, dp_rank: int) -> None:
        self._dp_rank = dp_rank

    def dp_rank(self) -> int:
        return self._dp_rank


def steps(*, seed: int, start: int, count: int, dp_rank: int = 0, world: int = 1) -> list[list[torch.Tensor]]:
    recipe = Recipe.from_dict({
        "model": {"preset": "qwen2_5_vl_tiny"},
        "data": {"num_samples": 24, "max_side": 56},
        "train": {"seed": seed, "micro_batch_tokens": 256, "max_steps": 100},
    })
    pm = build_plugin_manager(entry_points=False)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=world)
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"), log=structlog.get_logger(),
                     state=RunState(start_step=start), family=pm.models.for_recipe(recipe))
    iterator = iter(pm.call_first("weft_batching", decision=plan.decision("batching"), recipe=recipe, plan=plan,
                                  mesh=FakeMesh(dp_rank), model=None, ctx=ctx))
    return [[mb["input_ids"] for mb in next(iterator)] for _ in range(count)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))
                                    for x, y in zip(a, b))


def test_restart_mid_epoch_gives_the_same_order():
    fresh = steps(seed=3, start=0, count=12)  # 24 samples: the epoch ends before step 12
    resumed = steps(seed=3, start=5, count=7)
    assert same(fresh[5:], resumed)
    assert not same(fresh, steps(seed=4, start=0, count=12))  # another seed, another order


def test_data_parallel_ranks_see_disjoint_samples():
    recipe_lengths = [10, 30, 20, 25, 5, 40, 15, 35]
    batches = list(pack_micro_batches(recipe_lengths, budget=60, seed=0, epoch=0))
    assert sorted(i for b in batches for i in b) == list(range(len(recipe_lengths)))
    assert all(len(b) * max(recipe_lengths[i] for i in b) <= 60 for b in batches)
    for step in schedule_steps(batches, recipe_lengths, dp_size=2, step_tokens=0):
        for round_ in step:
            assert len(round_) == 2 and not set(round_[0]) & set(round_[1])


def test_the_global_schedule_gives_the_same_steps_at_any_data_parallel_size():
    """schedule = "global": step k holds the same micro-batches at dp 1, 2 and 3, dealt round-robin;
    a rank short of one in the last round gets a filler (None), never another step's data."""
    from weft.strategies.data.token_budget import schedule_global_steps

    lengths = [10, 30, 20, 25, 5, 40, 15, 35, 12, 18, 27, 9, 33]
    batches = list(pack_micro_batches(lengths, budget=60, seed=1, epoch=0))
    one = list(schedule_global_steps(batches, lengths, dp_size=1, step_tokens=100))
    assert [[r[0] for r in step] for step in one] == [
        [mb[0] for mb in step] for step in schedule_steps(batches, lengths, dp_size=1, step_tokens=100)]
    for dp in (2, 3):
        many = list(schedule_global_steps(batches, lengths, dp_size=dp, step_tokens=100))
        assert len(many) == len(one)
        for a, b in zip(one, many):
            assert all(len(r) == dp for r in b)
            dealt = [mb for r in b for mb in r]
            assert [r[0] for r in a] == [mb for mb in dealt if mb is not None]  # same, in order
            assert all(mb is None for mb in dealt[len(a):])  # fillers only at the end
    assert any(None in r for step in schedule_global_steps(batches, lengths, dp_size=2, step_tokens=100) for r in step)


def test_over_long_samples_are_left_out():
    batches = list(pack_micro_batches([10, 500, 20], budget=100, seed=0, epoch=0))
    assert sorted(i for b in batches for i in b) == [0, 2]


def test_prefetching_stops_its_thread_when_the_consumer_stops_early():
    """A consumer that leaves early (an error, enough items) ends the producer thread before
    it goes on: none is left running into interpreter exit. Errors reach the consumer at
    their item; a full pass yields every item in order."""
    import threading

    from weft.strategies.data.prefetch import prefetched

    def alive() -> int:
        return sum(t.name == "weft-prefetch" and t.is_alive() for t in threading.enumerate())

    assert list(prefetched(iter(range(10)), depth=2)) == list(range(10))
    items = prefetched(iter(range(1000)), depth=2)
    assert next(items) == 0 and alive() == 1
    items.close()
    assert alive() == 0

    def broken():
        yield 1
        raise ValueError("bad sample")

    with pytest.raises(ValueError, match="bad sample"):
        list(prefetched(broken(), depth=2))
    assert alive() == 0


def test_a_large_epoch_is_made_as_it_is_taken():
    """A million samples: the first micro-batches are taken without making the epoch's others
    (a generator); every sample that fits is in exactly one micro-batch, within budget."""
    import itertools

    lengths = torch.randint(8, 300, (1_000_000,), generator=torch.Generator().manual_seed(0)).tolist()
    first = list(itertools.islice(pack_micro_batches(lengths, budget=1024, seed=0, epoch=0), 10))
    assert len(first) == 10 and all(len(b) * max(lengths[i] for i in b) <= 1024 for b in first)
    small = lengths[:5000] + [2000]  # one over the budget
    batches = list(pack_micro_batches(small, budget=1024, seed=0, epoch=0))
    assert sorted(i for b in batches for i in b) == list(range(5000))
    assert all(len(b) * max(small[i] for i in b) <= 1024 for b in batches)
    assert batches == list(pack_micro_batches(small, budget=1024, seed=0, epoch=0))
    assert batches != list(pack_micro_batches(small, budget=1024, seed=0, epoch=1))
