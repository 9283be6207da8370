"""`weft eval`: a dataset's loss under the recipe's plan equals the unsharded model's forward
over each sample (float32 <= 1e-5), on one rank, under ring attention and data parallelism
(whose last round is padded with a label-less copy); weights from a run's checkpoint; the
user's mistakes are exit-2 messages."""

from __future__ import annotations

import io
import json
import pathlib

import pytest
from PIL import Image

from weft_cli import Done, run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny-vl.toml")
# 384 tokens per micro-batch: the 7 samples make 3 micro-batches, so dp 2 pads its last round.
SMALL = ["--set", "data.cache=false", "--set", "train.micro_batch_tokens=384"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("eval")
    buffer = io.BytesIO()
    Image.new("RGB", (56, 84), (200, 30, 30)).save(buffer, format="PNG")
    (folder / "red.png").write_bytes(buffer.getvalue())
    rows = []
    for i in range(7):
        if i % 2:
            rows.append({"messages": [{"role": "user", "content": "<image>Colour?"},
                                      {"role": "assistant", "content": f"Red, like tomato number {i}."}],
                         "images": ["red.png"]})
        else:
            rows.append({"messages": [{"role": "user", "content": f"Say something {i}"},
                                      {"role": "assistant", "content": "Something with labels " * (i + 1)}]})
    path = folder / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def weft(*args, cwd=None) -> Done:
    """In this process; the ranks a command starts are forked (tests/forked_ranks.py)."""
    return run_weft(*args, cwd=cwd)


def evaluate(data: pathlib.Path, *extra: str) -> dict:
    done = weft("eval", RECIPE, "--data", str(data), "--json", *SMALL, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def unsharded_loss(data: pathlib.Path) -> float:
    """The model as transformers ships it, one sample per forward, the mean over all labels."""
    import structlog
    import torch

    from weft.core.commands.check import reference
    from weft.core.context import RunContext
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe
    from weft.plugins.batching.samples import bad_sample_handler, collect_samples, pad_id_of, sample_source
    from weft.strategies.data.conversation import collate

    recipe = Recipe.from_toml(RECIPE, overrides=("data.source=jsonl", f"data.path={data}", "data.cache=false"))
    family = plugin_manager_from_env().models.for_recipe(recipe)
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"), log=structlog.get_logger())
    tokenizer, source = sample_source(recipe, family)
    samples = collect_samples(recipe, source, on_bad=bad_sample_handler(recipe, ctx))
    pad_id = pad_id_of(tokenizer, family.config(recipe)[0])
    batches = [collate([s], pad_id=pad_id) for s in samples]
    assert len(batches) == 7
    return reference(recipe, family=family, batches=batches, device="cpu")["fp32"]["loss"]


@pytest.fixture(scope="module")
def one_rank(data) -> dict:
    return evaluate(data, "--nproc", "1")


def test_one_rank_equals_the_unsharded_forward_per_sample(data, one_rank):
    expected = unsharded_loss(data)
    assert abs(one_rank["loss"] - expected) <= 1e-5 * abs(expected), (one_rank["loss"], expected)
    assert one_rank["perplexity"] == pytest.approx(2.718281828459045 ** one_rank["loss"], rel=1e-9)
    assert one_rank["micro_batches"] == 3 and one_rank["label_tokens"] > 100
    assert one_rank["skipped"] == {} and one_rank["checkpoint"] is None and one_rank["tokens_per_s"] > 0


@pytest.mark.parametrize("mesh", [["--set", "parallel.ring=2"], []], ids=["ring2", "dp2"])
def test_sharded_plans_give_the_unsharded_loss(data, one_rank, mesh):
    got = evaluate(data, "--nproc", "2", *mesh)
    assert abs(got["loss"] - one_rank["loss"]) <= 1e-5 * abs(one_rank["loss"]), (got["loss"], one_rank["loss"])
    # Every label token counted once: SP ranks share micro-batches, dp 2's padding round adds none.
    assert (got["label_tokens"], got["micro_batches"]) == (one_rank["label_tokens"], one_rank["micro_batches"])
    assert got["world_size"] == 2


def test_weights_from_a_run_checkpoint(data, one_rank, tmp_path):
    run = tmp_path / "run"
    done = weft("run", RECIPE, "--nproc", "1", "--run-dir", str(run), "--set", "train.max_steps=2",
                "--set", "data.num_samples=64", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = evaluate(data, "--nproc", "1", "--run-dir", str(run))
    ring = evaluate(data, "--nproc", "2", "--set", "parallel.ring=2", "--run-dir", str(run), "--step", "2")
    assert trained["checkpoint"].endswith("step-2") and trained["loss"] != pytest.approx(one_rank["loss"], rel=1e-4)
    assert abs(ring["loss"] - trained["loss"]) <= 1e-5 * abs(trained["loss"])


@pytest.mark.parametrize("args, message", [
    (["--data", "missing.jsonl"], "--data: no such file: missing.jsonl"),
    (["--step", "3"], "--step: --step picks a checkpoint of --run-dir"),
    (["--run-dir", "nowhere"], "--run-dir: nowhere has no checkpoints/ folder"),
])
def test_mistakes_are_messages(args, message, tmp_path):
    done = weft("eval", RECIPE, *args, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_eval_micro_batches_are_their_own_lever(data, one_rank):
    """eval.micro_batch_tokens (the held-out pass's out-of-memory lever) makes more, smaller
    micro-batches of the same samples: the same loss over the same label tokens."""
    smaller = evaluate(data, "--nproc", "1", "--set", "eval.micro_batch_tokens=256")
    assert smaller["micro_batches"] > one_rank["micro_batches"] and smaller["skipped"] == {}
    assert smaller["label_tokens"] == one_rank["label_tokens"]
    assert abs(smaller["loss"] - one_rank["loss"]) <= 1e-5 * abs(one_rank["loss"]), (smaller["loss"], one_rank["loss"])
