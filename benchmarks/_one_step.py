"""What benchmarks/step/profile_step.py and memory_peak.py share: a recipe's command line, and the
recipe run through weft's own loop up to the step watched and one more, with an in-process
plugin (a guard that starts its watch at that step's ``step_start`` and ends it at the next's)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from typing import Any


def arguments(description: str, *, step: int, extra: list[tuple[str, dict]] = ()) -> argparse.Namespace:
    """``RECIPE --out DIR [--set KEY=VALUE]... [--step N]`` and the script's own ``extra`` flags."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("recipe", help="a bundled recipe's name or a recipe file")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--step", type=int, default=step, help="the step watched (earlier steps warm up)")
    for flag, options in extra:
        parser.add_argument(flag, **options)
    return parser.parse_args()


def run_watched(args: argparse.Namespace, *, name: str, plugin: Any) -> list[dict] | None:
    """The recipe (``args``) for ``args.step + 1`` steps, no checkpoint, ``plugin`` in its plugin
    manager; the run's metrics rows on rank 0 (None on the other ranks, under torchrun)."""
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.core.train.loop import train

    args.out.mkdir(parents=True, exist_ok=True)
    overrides = [*args.overrides, f"train.max_steps={args.step + 1}", "train.checkpoint_every=-1"]
    recipe = Recipe.from_toml(args.recipe, overrides=tuple(overrides))
    pm = build_plugin_manager(extra=[(name, plugin)])
    run_dir = args.out / "run"
    run_dir.mkdir(exist_ok=True)
    train(recipe=recipe, pm=pm, run_dir=run_dir, resume=False, console=False)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 speaks for the step
        return None
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def title(args: argparse.Namespace) -> str:
    return f"{args.recipe} {' '.join(args.overrides)}: step {args.step}"
