"""What weft reads from elsewhere never runs code (docs/faults.md, "Untrusted inputs").

A checkpoint folder is writable by whoever shares the disk, and its manifest's checksums are no
signature: each test plants a pickle whose unpickling would touch a marker file, rewrites the
manifest to match, and shows that resume passes the checkpoint over, that export, eval and
generate refuse it with exit 2 naming the file, and that the marker never appears. The same
reader loads every checkpoint weft writes (tests/test_fsdp_checkpoint.py and the resume tests
read through it), bit for bit.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import pickle
import types

import pytest
import torch

from fault_runs import FAST, Planted, rewrite_manifest_entry


@pytest.fixture
def recipe(tmp_path) -> pathlib.Path:
    path = tmp_path / "fast.toml"
    path.write_text(FAST)
    return path


def plant_index(checkpoint: pathlib.Path, marker: pathlib.Path) -> None:
    """DCP's ``.metadata`` replaced by a pickle that runs code, the manifest made to agree."""
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    rewrite_manifest_entry(checkpoint, ".metadata")


def plant_value(checkpoint: pathlib.Path, marker: pathlib.Path, *, fqn: str = "optim.param_groups.0.lr") -> None:
    """A non-tensor value of the state (torch.save'd inside a .distcp file) replaced by one that
    runs code: the payload appended to its shard, the index (a true one, re-pickled) pointed at it."""
    index = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own run's index: the test trusts it
    key = next(k for k in index.storage_data if k.fqn == fqn)
    info = index.storage_data[key]
    payload = io.BytesIO()
    torch.save(Planted(marker), payload)
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(payload.getvalue())
    index.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(index))
    rewrite_manifest_entry(checkpoint, ".metadata")
    rewrite_manifest_entry(checkpoint, info.relative_path)


def summary(run_dir: pathlib.Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_planted_index_is_passed_over_on_resume(weft, trained, recipe, tmp_path):
    marker = tmp_path / "code-ran"
    plant_index(trained / "checkpoints" / "step-8", marker)
    done = weft("run", str(recipe), "--run-dir", str(trained), "--resume", "--set", "train.max_steps=9", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()
    assert "resuming from step-6: passed over step-8:" in done.stderr
    assert ".metadata asks to build pathlib.Path.touch" in done.stderr and "nothing in it ran" in done.stderr
    assert summary(trained)["start_step"] == 6 and summary(trained)["status"] == "completed"


def test_planted_value_is_passed_over_on_resume(weft, trained, recipe, tmp_path):
    marker = tmp_path / "code-ran"
    plant_value(trained / "checkpoints" / "step-8", marker)
    done = weft("run", str(recipe), "--run-dir", str(trained), "--resume", "--set", "train.max_steps=9", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()
    assert "passed over step-8:" in done.stderr and "(optim.param_groups.0.lr) is not plain data" in done.stderr
    assert summary(trained)["start_step"] == 6


def test_rng_state_planted_is_passed_over_on_resume(weft, trained, recipe, tmp_path):
    marker = tmp_path / "code-ran"
    newest = trained / "checkpoints" / "step-8"
    torch.save({"torch": Planted(marker)}, newest / "rng-rank0.pt")
    rewrite_manifest_entry(newest, "rng-rank0.pt")
    torch.save(Planted(marker), newest / "meta.pt")  # the old pickled metadata file: never read
    done = weft("run", str(recipe), "--run-dir", str(trained), "--resume", "--set", "train.max_steps=9", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()
    assert "passed over step-8: rng-rank0.pt holds something other than tensors and numbers" in done.stderr
    # torch's own message advises loading it with weights_only=False: how its code would run
    assert "weights_only" not in done.stderr and "Re-running" not in done.stderr
    assert summary(trained)["start_step"] == 6


@pytest.mark.parametrize("command", ["export", "eval", "generate"])
@pytest.mark.parametrize("plant", [plant_index, plant_value], ids=["index", "value"])
def test_commands_refuse_a_planted_checkpoint(weft, trained, recipe, tmp_path, command, plant):
    marker = tmp_path / "code-ran"
    plant(trained / "checkpoints" / "step-8", marker)
    args = {"export": ["export", str(trained), str(tmp_path / "out")],
            "eval": ["eval", str(recipe), "--run-dir", str(trained)],
            "generate": ["generate", str(recipe), "--prompt", "hello", "--max-new-tokens", "2",
                         "--run-dir", str(trained)]}[command]
    done = weft(*args, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not marker.exists()
    named = ".metadata asks to build pathlib.Path.touch" if plant is plant_index else \
        "(optim.param_groups.0.lr) is not plain data"
    assert f"{trained / 'checkpoints' / 'step-8'}: this checkpoint is refused: " in done.stderr
    assert named in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_the_reader_loads_plain_values_bit_for_bit_and_refuses_others(tmp_path):
    import torch.distributed.checkpoint as dcp

    from weft.core.checkpoint import dcp_read

    weights = torch.randn(5, 3, dtype=torch.float64)
    good = tmp_path / "good"
    dcp.save({"w": weights, "lr": 3e-4, "betas": (0.9, 0.95), "dtype": torch.bfloat16, "rule": "text"},
             checkpoint_id=str(good), no_dist=True)
    assert dcp_read.plain_data(good) is None
    state = {"w": torch.zeros(5, 3, dtype=torch.float64), "lr": 0.0, "betas": (0.0, 0.0), "dtype": None, "rule": ""}
    dcp_read.load(state, good)
    assert torch.equal(state["w"], weights)
    assert (state["lr"], state["betas"], state["dtype"], state["rule"]) == (3e-4, (0.9, 0.95), torch.bfloat16, "text")

    marker, bad = tmp_path / "code-ran", tmp_path / "bad"
    dcp.save({"w": weights, "hook": Planted(marker)}, checkpoint_id=str(bad), no_dist=True)  # written, not run
    assert "(hook) is not plain data" in dcp_read.plain_data(bad)
    with pytest.raises(dcp_read.UnsafeCheckpoint, match=r"\(hook\) is not plain data"):
        dcp_read.load({"w": torch.zeros(5, 3, dtype=torch.float64), "hook": None}, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(dcp_read.UnsafeCheckpoint, match="asks to build pathlib.Path.touch"):
        dcp_read.read_metadata(bad)
    (bad / ".metadata").write_bytes(pickle.dumps({"not": "an index"}))
    with pytest.raises(dcp_read.UnsafeCheckpoint, match="holds a dict, not a checkpoint index"):
        dcp_read.read_metadata(bad)
    assert not marker.exists()


def test_out_of_memory_in_the_held_out_pass_is_one_message(weft, recipe, tmp_path, monkeypatch):
    """An allocation that fails inside [eval]'s pass after step 4: weft's message (the pass, the
    levers of evaluation, the intact step-2 checkpoint), exit 1, no traceback, step-2 whole."""
    from weft.core.run import checkpoint
    from weft.core.train import evaluation

    run_dir = tmp_path / "run"
    real = evaluation.run_micro_batches

    def failing(**kw):
        if (run_dir / "checkpoints" / "step-2").is_dir():  # the second pass: a checkpoint to keep
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(**kw)

    monkeypatch.setattr(evaluation, "run_micro_batches", failing)
    done = weft("run", str(recipe), "--run-dir", str(run_dir), "--set", "eval.every=2", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("weft: error:") == 1
    message = done.stderr[done.stderr.index("weft: error:"):]
    assert "out of GPU memory in the held-out pass ([eval]) after step 4, rank 0, micro-batches of 64 tokens" \
        in message
    assert "eval.micro_batch_tokens = 32 (now 64" in message and 'train.loss = "fused"' in message
    assert "eval.every = 4 or 0 (now 2)" in message and "The last checkpoint (step-2) is intact" in message
    assert checkpoint.verify(run_dir / "checkpoints" / "step-2") is None
    assert summary(run_dir)["status"] == "failed" and "held-out pass" in summary(run_dir)["reason"]


@pytest.mark.quick
def test_out_of_memory_in_weft_eval_names_its_levers():
    from weft.core.recipe import Recipe
    from weft.core.train.oom import eval_out_of_memory

    ctx = types.SimpleNamespace(recipe=Recipe.from_toml("tiny-vl", overrides=("train.loss=fused",)), rank=1,
                                device=torch.device("cpu"), run_dir=None)
    error = eval_out_of_memory(after_step=None, local_tokens=(512, 300), ctx=ctx)
    assert str(error).count("out of GPU memory in `weft eval`, rank 1, micro-batches of 512, 300 tokens") == 1
    assert "eval.micro_batch_tokens = 256" in str(error) and "train.loss" not in str(error)
    assert "eval.every" not in str(error) and error.exit_code == 1
