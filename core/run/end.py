"""How a run ended, always written down: ``summary.json`` and one ``run.end`` log event.

``status``: ``completed``; ``interrupted`` (a signal: the run stopped after a step and,
unless the recipe writes no checkpoints, saved it); ``aborted`` (a guard stopped it);
``failed`` (an error). With the reason, the last finished step and the last checkpoint
written in this process, so a script (or a person) reading the run directory knows what
happened without the logs.
"""

from __future__ import annotations

import json
import pathlib
import time
import traceback
from typing import TYPE_CHECKING

import attrs

from weft.core.errors import GuardAbort
from weft.core.run.collectives import global_max
from weft.core.whole_files import write_json_whole, write_lines_whole

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.recipe import Recipe


@attrs.define(kw_only=True)
class Ending:
    t_start: float
    status: str = "completed"
    reason: str = ""
    last_step: int | None = None
    aborted_step: int | None = None  # the step a guard stopped (its row in metrics.jsonl says so)
    loss: float | None = None
    checkpoint: str | None = None
    best: dict | None = None  # eval.keep_best: the checkpoint of the lowest held-out loss
    totals: dict = attrs.field(factory=lambda: {"tokens": 0, "train_s": 0.0, "skipped_steps": 0})
    written: bool = False

    def record(self, recipe: Recipe, ctx: RunContext, *, error: BaseException | None = None,
               positions: bool = False) -> dict:
        """Write the summary (rank 0) and log the ending; once. ``positions``: the ranks are in
        step and may all-reduce the largest position (never on an error path)."""
        if error is not None:
            self.status = ("aborted" if isinstance(error, GuardAbort)
                           else "interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
            self.reason = (str(error).splitlines() or [type(error).__name__])[0][:500]
        watch = ctx.positions  # None when the run failed before the model was prepared
        largest = watch.largest if watch is not None else None
        if positions and watch is not None:
            largest = global_max(largest, device=ctx.device)
        summary = {
            "status": self.status,
            "reason": self.reason,
            "last_step": self.last_step,
            "last_checkpoint": self.checkpoint,
            **({"best_checkpoint": self.best} if self.best is not None else {}),
            **({"aborted_step": self.aborted_step} if self.aborted_step is not None else {}),
            # The last step that ran (a step a guard stopped included; 0: none) and the steps the run was to take.
            "steps": max(self.aborted_step or 0, self.last_step or 0),
            "max_steps": recipe.train.max_steps,
            "start_step": ctx.start_step,
            "final_loss": self.loss,
            "tokens": self.totals["tokens"],
            "tokens_per_s": self.totals["tokens"] / self.totals["train_s"] if self.totals["train_s"] else 0.0,
            "skipped_samples": ctx.counters.get("skipped_samples", 0),
            "truncated_samples": ctx.counters.get("truncated_samples", 0),
            # batching's schedule = "global": label-less copies run where a step left a rank none
            "filler_micro_batches": ctx.counters.get("filler_micro_batches", 0),
            "skipped_steps": self.totals["skipped_steps"],
            "wall_s": time.perf_counter() - self.t_start,
            "world_size": ctx.world_size,
            # Over every rank's batches: how close the data came to the rotary context.
            "largest_position": largest,
            "rope_context": watch.context if watch is not None else None,
            # rank 0's weights, gradients and optimizer states after the first step (GiB)
            "state_gib": self.totals.get("state_gib"),
        }
        if self.written:
            return summary
        self.written = True
        if error is not None and not isinstance(error, GuardAbort):
            ctx.log.error("run.error", traceback="".join(traceback.format_exception(error)), file_only=True)
        if ctx.rank == 0:
            write_json_whole(ctx.run_dir / "summary.json", summary, indent=1)  # read by watchers
            (ctx.log.info if self.status in ("completed", "interrupted") else ctx.log.error)("run.end", **summary)
        return summary


def trim_metrics(path: pathlib.Path, *, last_step: int) -> None:
    """Drop the rows of steps after ``last_step`` (a resume repeats them), atomically."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and _step_of(line) <= last_step]
    write_lines_whole(path, kept)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line: dropped
