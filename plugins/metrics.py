"""Metrics hook: where each step's metrics row (and the run's summary) goes.

- ``jsonl`` (the default rules'): ``metrics.jsonl`` in the run directory, one JSON object
  per step, flushed as written; resume and `weft report` read it;
- ``tensorboard``: event files through torch's ``SummaryWriter`` (needs the
  ``tensorboard`` package), every number of the row as a scalar at its step;
- ``wandb``: a Weights & Biases run, offline by default (its folder under the run
  directory; ``wandb sync`` uploads it later), the recipe as its config, the summary at
  the end (needs the ``wandb`` package).

A missing package is a plan error naming it, before any rank starts. Sinks keep their
writers in ``ctx.plugin_state`` (one run, no module state).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from typing import Literal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import Declared, NoParams, Strategy


@attrs.frozen(kw_only=True)
class TensorBoardParams:
    log_dir: str = attrs.field(default="", metadata={"doc": "event files' folder; empty = <run dir>/tensorboard"})


@attrs.frozen(kw_only=True)
class WandbParams:
    project: str = attrs.field(default="weft", metadata={"doc": "the W&B project"})
    mode: Literal["offline", "online"] = attrs.field(default="offline", metadata={
        "doc": "offline: the run's folder only (wandb sync uploads it); online: streamed to the server"})


def _needs(package: str, extra: str):
    def check(params, *, recipe, plan) -> str | None:
        if importlib.util.find_spec(package) is None:
            return f"this sink needs the {package!r} package, which is not installed: pip install {extra}"
        return None

    return check


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_metrics(event, row, plan, ctx):
    # Each sink's ``impl(params, event=, row=, ctx=)``.
    for decision in plan.decisions_of("metrics"):
        sink = STRATEGIES.of(decision)
        if sink is not None and ctx.run_dir is not None:
            sink.impl(decision.params, event=event, row=row, ctx=ctx)


def _jsonl(params, *, event: str, row: dict, ctx) -> None:
    if event == "step":
        with (pathlib.Path(ctx.run_dir) / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


def _numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k != "step"}


def _tensorboard(params: TensorBoardParams, *, event: str, row: dict, ctx) -> None:
    writer = ctx.plugin_state.get("metrics:tensorboard")
    if writer is None:
        from torch.utils.tensorboard import SummaryWriter

        folder = pathlib.Path(params.log_dir) if params.log_dir else pathlib.Path(ctx.run_dir) / "tensorboard"
        writer = ctx.plugin_state["metrics:tensorboard"] = SummaryWriter(log_dir=str(folder))
    if event == "step":
        for name, value in _numbers(row).items():
            writer.add_scalar(f"train/{name}", value, global_step=row["step"])
        writer.add_scalar("train/skipped", float(bool(row.get("skipped"))), global_step=row["step"])
        writer.flush()
    else:
        writer.add_text("summary", json.dumps(row, indent=1, default=str))
        writer.close()
        ctx.plugin_state.pop("metrics:tensorboard")


def _wandb(params: WandbParams, *, event: str, row: dict, ctx) -> None:
    run = ctx.plugin_state.get("metrics:wandb")
    if run is None:
        import wandb

        run = ctx.plugin_state["metrics:wandb"] = wandb.init(
            project=params.project, mode=params.mode, dir=str(ctx.run_dir), name=pathlib.Path(ctx.run_dir).name,
            config=json.loads(json.dumps(attrs.asdict(ctx.recipe), default=str)))
    if event == "step":
        run.log(dict(_numbers(row), skipped=bool(row.get("skipped"))), step=row["step"])
    else:
        run.summary.update({k: v for k, v in row.items() if isinstance(v, (int, float, str, bool))})
        run.finish()
        ctx.plugin_state.pop("metrics:wandb")


STRATEGIES = Declared(
    Strategy(point="metrics", name="jsonl", params=NoParams, impl=_jsonl,
             summary="metrics.jsonl in the run directory (resume and weft report read it)"),
    Strategy(point="metrics", name="tensorboard", params=TensorBoardParams, impl=_tensorboard,
             summary="TensorBoard event files, every number of a row as a scalar",
             check=_needs("tensorboard", "tensorboard")),
    Strategy(point="metrics", name="wandb", params=WandbParams, impl=_wandb,
             summary="a Weights & Biases run, offline by default", check=_needs("wandb", "wandb")),
)
