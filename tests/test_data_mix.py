"""Several sources mixed by weight or count, epochs, and where a resumed run picks the data up:
the mixture's shares are exact and drawn from the seed; two epochs see every sample of the
mixture twice; a run resumed mid-epoch from a checkpoint (on 1 rank, and on 2) trains on the
samples and losses of the run that was never stopped (ids from samples.jsonl)."""

from __future__ import annotations

import collections
import json
import random
import shutil

import pytest

from weft.strategies.data.mixture import Mixture, chosen, quotas


class _Counted(list):
    """Stand-in samples: a store's token counts, nothing to read."""

    @property
    def token_counts(self):
        return [1] * len(self)


@pytest.mark.quick
def test_weights_give_their_shares_and_the_seed_the_draw():
    sizes = [6000, 4000, 3000]
    counts = quotas(sizes, weights=[0.5, 0.3, 0.2], samples=[None] * 3, total=10_000)
    assert counts == [5000, 3000, 2000]
    # Unnormalised weights and a total that does not divide: the largest remainders take the rest.
    assert quotas(sizes, weights=[5, 3, 2], samples=[None] * 3, total=10_001) == [5001, 3000, 2000]
    # Without a total: as many as the first source to run out allows (6000 / 0.5 = 12,000).
    assert quotas(sizes, weights=[0.5, 0.3, 0.2], samples=[None] * 3) == [6000, 3600, 2400]
    # Counts: repeats past a source's size; a source with neither key gives all it has.
    assert quotas(sizes, weights=[None] * 3, samples=[8000, None, 10]) == [8000, 4000, 10]
    with pytest.raises(ValueError, match="not both"):
        quotas(sizes, weights=[0.5, None, None], samples=[None, 10, None])

    picks = [chosen(size, count, seed=7, source=n) for n, (size, count) in enumerate(zip(sizes, counts))]
    mixture = Mixture([_Counted(range(size)) for size in sizes], picks)
    shares = collections.Counter(source for source, _ in mixture.ids)
    assert [shares[n] / len(mixture) for n in range(3)] == [0.5, 0.3, 0.2]
    # Over any stretch of 10,000 of a shuffled epoch the shares hold within 1%.
    order = list(range(len(mixture)))
    random.Random(0).shuffle(order)
    window = collections.Counter(mixture.ids[k][0] for k in order[:10_000])
    assert all(abs(window[n] / 10_000 - share) < 0.01 for n, share in enumerate([0.5, 0.3, 0.2]))
    # Each source's samples: distinct until it is exhausted; the same from the same seed only.
    assert all(len(set(p)) == len(p) for p in picks)
    assert picks == [chosen(s, c, seed=7, source=n) for n, (s, c) in enumerate(zip(sizes, counts))]
    assert picks[0] != chosen(6000, 5000, seed=8, source=0)
    repeated = chosen(3, 7, seed=0, source=0)
    assert sorted(repeated[:3]) == [0, 1, 2] and sorted(repeated[3:6]) == [0, 1, 2]


def _chat(n: int, source: str) -> str:
    words = "red green blue small large square round left right".split()
    rng = random.Random(f"{source}{n}")
    question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
    answer = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
    return json.dumps({"messages": [{"role": "user", "content": f"{source} {n}: {question}"},
                                    {"role": "assistant", "content": answer}]}) + "\n"


RECIPE = '''
[model]
preset = "qwen2_5_vl_tiny"
[data]
source = "jsonl"
mix_samples = 40
[[data.sources]]
path = "a.jsonl"
weight = 0.5
[[data.sources]]
path = "b.jsonl"
weight = 0.3
[[data.sources]]
path = "c.jsonl"
weight = 0.2
[train]
epochs = 2
micro_batch_tokens = 256
step_tokens = 512
checkpoint_every = 2
keep_checkpoints = 10
log_samples = true
lr = 1e-3
warmup_steps = 1
[parallel]
nproc = 1
[[rules]]
batching = { strategy = "token_budget", schedule = "global" }
'''


def _samples(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _ids(row: dict) -> list:
    """A step's sample ids, whichever rank and micro-batch took them."""
    return sorted(tuple(i) for rank in row["ranks"] for mb in rank if mb is not None for i in mb)


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    from weft_cli import run_weft

    folder = tmp_path_factory.mktemp("mix")
    for name, size in (("a", 30), ("b", 20), ("c", 10)):
        (folder / f"{name}.jsonl").write_text("".join(_chat(n, name) for n in range(size)))
    (folder / "mix.toml").write_text(RECIPE)
    done = run_weft("run", str(folder / "mix.toml"), "--run-dir", str(folder / "run"), cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def test_two_epochs_see_the_mixture_twice(mixed_run):
    rows = _samples(mixed_run / "run")
    summary = json.loads((mixed_run / "run" / "summary.json").read_text())
    assert [row["step"] for row in rows] == list(range(1, summary["steps"] + 1))
    seen = collections.Counter(i for row in rows for i in _ids(row))
    by_source = collections.Counter(source for source, _ in seen.elements())
    assert by_source == {0: 40, 1: 24, 2: 16}  # 0.5 / 0.3 / 0.2 of 40, twice
    assert set(seen.values()) == {2}  # each chosen sample once an epoch
    assert len(_losses(mixed_run / "run")) == summary["steps"] == len(rows)


def _resumed(run_dir, tmp_path, *, stop: int, nproc: int, recipe):
    """A copy of ``run_dir`` as a run killed after step ``stop``'s checkpoint leaves it (that
    checkpoint, and metrics and sample rows past it), resumed on ``nproc`` ranks."""
    from weft_cli import run_weft

    broken = tmp_path / f"resumed-{nproc}"
    shutil.copytree(run_dir, broken)
    for checkpoint in (broken / "checkpoints").iterdir():
        if checkpoint.is_dir() and int(checkpoint.name.split("-")[1]) > stop:
            shutil.rmtree(checkpoint)
    done = run_weft("run", str(recipe), "--run-dir", str(broken), "--resume", "--nproc", str(nproc), cwd=recipe.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((broken / "summary.json").read_text())["start_step"] == stop
    return broken


def test_resumed_mid_epoch_trains_on_the_same_samples(mixed_run, tmp_path):
    """On 1 rank: killed at step 4 of the first epoch, resumed, the same sample ids and the same
    losses to the bit. The one-rank checkpoint resumed on 2 ranks (schedule "global"): the same
    ids, the losses within float32 summation order."""
    unbroken = mixed_run / "run"
    before = _samples(unbroken)
    stop = 4  # within the first epoch, not at its end
    assert stop < len(before) // 2
    one = _resumed(unbroken, tmp_path, stop=stop, nproc=1, recipe=mixed_run / "mix.toml")
    assert _samples(one) == before and _losses(one) == _losses(unbroken)
    two = _resumed(unbroken, tmp_path, stop=stop, nproc=2, recipe=mixed_run / "mix.toml")
    after = _samples(two)
    assert [row["step"] for row in after] == list(range(1, len(before) + 1))
    assert [_ids(row) for row in after] == [_ids(row) for row in before]
    assert all(len(row["ranks"]) == 2 for row in after[stop:])
    assert _losses(two) == pytest.approx(_losses(unbroken), rel=1e-4)


def test_a_two_rank_run_resumed_on_two_ranks_is_the_unbroken_one(mixed_run, tmp_path):
    from weft_cli import run_weft

    unbroken = tmp_path / "two"
    done = run_weft("run", str(mixed_run / "mix.toml"), "--run-dir", str(unbroken), "--nproc", "2", cwd=mixed_run)
    assert done.returncode == 0, done.stderr[-3000:]
    # The global schedule: the one-rank run's samples, dealt over two ranks.
    assert [_ids(row) for row in _samples(unbroken)] == [_ids(row) for row in _samples(mixed_run / "run")]
    resumed = _resumed(unbroken, tmp_path, stop=4, nproc=2, recipe=mixed_run / "mix.toml")
    assert _samples(resumed) == _samples(unbroken) and _losses(resumed) == _losses(unbroken)


@pytest.mark.quick
def test_a_held_out_file_replaces_the_mixture_in_eval_data():
    from weft.core.recipe import Recipe

    recipe = Recipe.from_dict({
        "model": {"preset": "qwen2_5_vl_tiny"},
        "data": {"source": "jsonl", "mix_samples": 10, "sources": [{"path": "a.jsonl", "weight": 1.0}]},
        "eval": {"every": 5, "data": {"path": "val.jsonl"}},
    })
    assert recipe.eval.data.path == "val.jsonl" and recipe.eval.data.sources == () and not recipe.eval.data.mix_samples
    assert recipe.data.sources[0].weight == 1.0 and recipe.data.path is None
