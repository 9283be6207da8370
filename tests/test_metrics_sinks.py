"""Metrics sinks (`metrics` hook point): one tiny run with jsonl, TensorBoard and offline
W&B sinks together; TensorBoard's own event reader finds every step's loss, W&B's offline
folder holds the run; a sink whose package is missing is a plan error naming it."""

from __future__ import annotations

import json
import pathlib

import pytest

from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("sinks")
    groups = ROOT / "recipes" / "rules" / "modality-groups.toml"
    recipe = (ROOT / "recipes" / "tiny-vl.toml").read_text().replace(
        'include = ["rules/modality-groups.toml"]', f'include = ["{groups}"]')
    recipe += ('\n[[rules]]\nname = "three sinks"\n'
               'metrics = [{ strategy = "jsonl" }, { strategy = "tensorboard" }, { strategy = "wandb" }]\n')
    (folder / "sinks.toml").write_text(recipe)
    done = run_weft("run", "sinks.toml", "--nproc", "1", "--run-dir", "run",
                    "--set", "train.max_steps=3", "--set", "data.num_samples=64", cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def test_tensorboard_events_hold_every_steps_loss(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert {"train/tokens_per_s", "train/grad_norm", "train/lr", "train/skipped"} <= set(events.Tags()["scalars"])


def test_offline_wandb_writes_its_run_folder(run):
    folders = list((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 1
    records = list(folders[0].glob("run-*.wandb"))
    assert records and records[0].stat().st_size > 1000  # the run's history, config and summary


@pytest.mark.quick
def test_a_missing_package_is_named():
    from weft.plugins.metrics import _needs

    message = _needs("weft_no_such_package", "weft_no_such_package")(None, recipe=None, plan=None)
    assert message == ("this sink needs the 'weft_no_such_package' package, which is not installed: "
                       "pip install weft_no_such_package")
    assert _needs("json", "json")(None, recipe=None, plan=None) is None
