"""A run directory that already holds a run: refused without ``--resume``, or moved aside whole
with ``--overwrite``. A new run into it would interleave its metrics with the old run's, replace
its recipe.json, and let ``keep_checkpoints`` prune by step number across both runs (the new
run's early checkpoints first): the old result silently damaged, the new one lost.

"Holds a run" means a step was recorded: a checkpoint folder, a metrics row, or a summary with a
last step. A directory left by a start that failed before its first step holds nothing to
protect; a new run continues its log.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib

from weft.core.errors import WeftError
from weft.core.run.lock import LOCK


def previous_run(run_dir: pathlib.Path) -> str | None:
    """What ``run_dir`` holds, in words (its state, last step and last checkpoint); None when
    it holds no run (missing, empty, or a start that never reached a step)."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"), key=_step_number)
    steps = _metrics_steps(run_dir / "metrics.jsonl")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        summary = summary if isinstance(summary, dict) else {}
    except (OSError, ValueError):
        summary = {}
    if not checkpoints and not steps and summary.get("last_step") is None:
        return None
    state = summary.get("status") or "unfinished (no summary.json: killed, or still starting)"
    last = summary.get("last_step") if summary.get("last_step") is not None else (steps[-1] if steps else None)
    saved = checkpoints[-1].name if checkpoints else "none"
    return f"a {state} run (last step {last if last is not None else 'none'}, last checkpoint {saved})"


def settle_previous_run(run_dir: pathlib.Path, *, overwrite: bool) -> pathlib.Path | None:
    """Refuse a ``run_dir`` that holds a run (exit 2), or with ``overwrite`` move its files
    (all but the lock this process holds) into a sibling folder, returned. Called under the
    run directory's lock, after the recipe was checked: a user error leaves the old run as it
    was."""
    held = previous_run(run_dir)
    if held is None:
        return None
    if not overwrite:
        longer = " and a larger train.max_steps" if "completed" in held else ""
        raise WeftError(
            f"{run_dir} holds {held}; a new run would mix its metrics and checkpoints with that run's. Continue "
            f"it with --resume{longer}, give another --run-dir, or start over with --overwrite (the old run's files "
            f"are moved to a folder beside it, {run_dir.name}.old-<date>, nothing deleted)", where="--run-dir")
    aside = _free_name(run_dir)
    aside.mkdir()
    for entry in sorted(run_dir.iterdir()):
        if entry.name != LOCK:
            os.replace(entry, aside / entry.name)  # one filesystem: a rename, nothing copied
    return aside


def _free_name(run_dir: pathlib.Path) -> pathlib.Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}" + (f"-{n}" if n else ""))
        if not aside.exists():
            return aside
    raise WeftError(f"no free name beside {run_dir} to move the old run to", where="--overwrite")


def _step_number(path: pathlib.Path) -> int:
    tail = path.name.removeprefix("step-")
    return int(tail) if tail.isdigit() else -1


def _metrics_steps(path: pathlib.Path) -> list[int]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps
