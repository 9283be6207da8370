"""A skipped step uses up its place in the learning-rate schedule, and says nothing about it
(docs/faults.md, "A skipped step and the learning rate")."""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest

from weft.core.hookspecs import hookimpl
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import Recipe
from weft.core.registry import Verdict
from weft.core.train.optimizer_setup import lr_lambda


class SkipSteps:
    """A guard that skips the steps it is given."""

    def __init__(self, steps):
        self.steps = set(steps)

    @hookimpl
    def weft_guard(self, event, state):
        if event == "step_end" and state.step in self.steps:
            return Verdict(action="skip", guard="test", reason="told to")
        return None


def test_skipped_steps_keep_the_schedule_and_warn_nothing(tmp_path: pathlib.Path):
    from weft.core.train.loop import train

    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "qwen2_text_tiny"\n'
                    "[train]\nmax_steps = 5\nwarmup_steps = 2\nlr = 1e-3\nmicro_batch_tokens = 256\n"
                    '[parallel]\nnproc = 1\ndevice = "cpu"\n')
    recipe = Recipe.from_toml(path)
    pm = build_plugin_manager(extra=[("skip", SkipSteps({1, 3}))], entry_points=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = train(recipe=recipe, pm=pm, run_dir=tmp_path / "run", resume=False, console=False)
    assert summary["skipped_steps"] == 2
    schedule = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert not schedule, schedule
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [True, False, True, False, False]
    factor = lr_lambda(recipe)
    # Step n trains at the schedule's value for n - 1 completed steps, skipped ones counted.
    assert [r["lr"] for r in rows] == pytest.approx([1e-3 * factor(n) for n in range(5)])


def test_an_unskipped_step_keeps_torchs_warning():
    """The warning is silenced for skipped steps only: a loop that advances the schedule before
    its optimizer ever stepped, without a skip, still hears about it."""
    import torch

    from weft.core.train.optimizer_setup import advance_schedule

    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        advance_schedule(scheduler, skipped=False)
