"""Every command that reads a checkpoint checks its manifest, and what --resume does not use is
kept (docs/faults.md, "Checkpoints"; issue 69, items 3, 6 and 7).

A damaged checkpoint here is the probe's: 16 bytes flipped in place inside a weight of the
newest checkpoint's shard, the file's size and the manifest untouched, so only the CRC-32 tells.
Export, eval and generate share one damaged copy of the module's trained run (they only read
it); the resume tests each break a copy of their own.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil

import pytest
import torch

from fault_runs import FAST


@pytest.fixture
def recipe(tmp_path) -> pathlib.Path:
    path = tmp_path / "fast.toml"
    path.write_text(FAST)
    return path


def flip_a_weight(checkpoint: pathlib.Path) -> pathlib.Path:
    """16 bytes in the middle of the first model tensor's stored bytes inverted; the shard keeps
    its size and the manifest its old CRC-32. Returns the shard."""
    index = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own run's index: the test trusts it
    key = next(k for k in sorted(index.storage_data, key=lambda k: k.fqn) if k.fqn.startswith("model."))
    info = index.storage_data[key]
    shard = checkpoint / info.relative_path
    data = bytearray(shard.read_bytes())
    start = info.offset + info.length // 2 - 8
    data[start:start + 16] = bytes(b ^ 0xFF for b in data[start:start + 16])
    size = shard.stat().st_size
    shard.write_bytes(bytes(data))
    assert shard.stat().st_size == size
    return shard


@pytest.fixture(scope="module")
def flipped(trained_once, tmp_path_factory) -> pathlib.Path:
    """A copy of the module's run whose newest checkpoint (step-8) has a flipped weight."""
    run_dir = tmp_path_factory.mktemp("flipped") / "run"
    shutil.copytree(trained_once, run_dir)
    flip_a_weight(run_dir / "checkpoints" / "step-8")
    return run_dir


def rejected_events(run_dir: pathlib.Path) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.startswith("{")]
    return [e for e in events if e.get("event") == "checkpoint.rejected"]


@pytest.mark.parametrize("command", ["export", "eval", "generate"])
def test_a_flipped_weight_is_refused_naming_the_file(weft, flipped, tmp_path, command):
    """Item 3: no command uses a damaged weight; nothing is written to the export folder."""
    (tmp_path / "fast.toml").write_text(FAST)
    out = tmp_path / "out"
    args = {"export": ["export", str(flipped), str(out)],
            "eval": ["eval", str(tmp_path / "fast.toml"), "--run-dir", str(flipped)],
            "generate": ["generate", str(tmp_path / "fast.toml"), "--prompt", "hello", "--max-new-tokens", "2",
                         "--run-dir", str(flipped)]}[command]
    done = weft(*args, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (f"{flipped / 'checkpoints' / 'step-8'}: this checkpoint is refused: __0_0.distcp does not match its "
            "checksum (CRC-32 ") in done.stderr
    assert "--step 6 reads the newest of them" in done.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_a_flipped_byte_is_passed_over_by_resume_naming_the_checksum(weft, trained, recipe, tmp_path):
    """Item 3 (Done when): --resume falls back past a same-size, manifest-untouched flip; the
    damaged folder is kept aside (item 7), out of the rotation's reach (keep_checkpoints = 1)."""
    shard = flip_a_weight(trained / "checkpoints" / "step-8")
    damaged = shard.read_bytes()
    done = weft("run", str(recipe), "--run-dir", str(trained), "--resume", "--set", "train.max_steps=10",
                "--set", "train.keep_checkpoints=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from step-6: passed over step-8: __0_0.distcp does not match its checksum" in done.stderr
    assert "(moved aside to step-8.refused-" in done.stderr
    assert json.loads((trained / "summary.json").read_text())["start_step"] == 6
    checkpoints = trained / "checkpoints"
    [aside] = checkpoints.glob("step-8.refused-*")
    assert (aside / "__0_0.distcp").read_bytes() == damaged  # the evidence, byte for byte
    assert sorted(p.name for p in checkpoints.glob("step-*") if p != aside) == ["step-10"]
    assert [e["checkpoint"] for e in rejected_events(trained)] == ["step-8"]


def test_a_checkpoint_without_manifest_is_named_and_kept(weft, trained, recipe, tmp_path):
    """Item 7: a step-N folder without its manifest is said in one line (stderr and log) and
    set aside; the resumed run's save at step 8 does not overwrite it."""
    step8 = trained / "checkpoints" / "step-8"
    (step8 / "manifest.json").unlink()
    planted = (step8 / "__0_0.distcp").read_bytes()
    done = weft("run", str(recipe), "--run-dir", str(trained), "--resume", "--set", "train.max_steps=9", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if "passed over" in line]
    assert line.startswith("weft: resuming from step-6: passed over step-8: it has no manifest.json")
    assert "not used (moved aside to step-8.refused-" in line
    [event] = rejected_events(trained)
    assert event["checkpoint"] == "step-8" and "no manifest.json" in event["reason"]
    [aside] = (trained / "checkpoints").glob("step-8.refused-*")
    assert (aside / "__0_0.distcp").read_bytes() == planted
    assert (step8 / "manifest.json").is_file()  # the resumed run's own step 8


@pytest.fixture
def group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_state():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return dict(model=model, optimizer=optimizer, scheduler=scheduler)


@pytest.mark.quick
def test_a_save_moves_a_folder_in_its_way_aside(tmp_path, group):
    """Item 7: a step-N folder already there when step N is saved is renamed, never removed,
    and the rotation leaves it alone."""
    from weft.core.run import checkpoint

    kw = dict(run_dir=tmp_path, rank=0, keep=1, **tiny_state())
    planted = tmp_path / "checkpoints" / "step-1"
    planted.mkdir(parents=True)
    (planted / "evidence").write_text("kept")
    first = checkpoint.save(step=1, **kw)
    [aside] = (tmp_path / "checkpoints").glob("step-1.replaced-*")
    assert (aside / "evidence").read_text() == "kept" and checkpoint.verify(first) is None
    checkpoint.save(step=2, **kw)  # keep = 1: step-1 rotated out, the folder set aside not
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-2"] and aside.is_dir()


def test_export_into_a_file_is_refused(weft, trained_once, tmp_path):
    """Item 6: exit 2 naming the path, not FileExistsError's traceback."""
    target = tmp_path / "model"
    target.write_text("mine")
    done = weft("export", str(trained_once), str(target), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{target} is a file, not a folder" in done.stderr and target.read_text() == "mine"


def test_export_into_a_folder_that_holds_files(weft, trained_once, tmp_path):
    """Item 7: refused naming the folder and what it holds; --overwrite replaces it whole."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = weft("export", str(trained_once), str(out), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{out} already holds 1 entry (notes.txt)" in done.stderr and "--overwrite" in done.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    done = weft("export", str(trained_once), str(out), "--overwrite", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file()
    assert json.loads((out / "weft_export.json").read_text())["checkpoint"] == "step-8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary folder left beside it
