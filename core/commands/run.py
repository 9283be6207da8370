"""`weft run`: everything a user can get wrong checked before any rank starts, the run
directory locked, then one process or local ranks through torch's elastic launcher."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING

from weft.core.errors import EXIT_OK, WeftError
from weft.core.plugin_manager import WeftPluginManager, plugin_manager_from_env
from weft.core.run.lock import join_run, run_lock
from weft.core.run.model_files import check_processor_files, check_weight_files, data_needs, reads_images
from weft.core.run.previous_run import settle_previous_run
from weft.core.run.rank_errors import clear, note, noted

if TYPE_CHECKING:
    from weft.core.recipe import Recipe


def recipe_record(recipe: Recipe, overrides: list[str]) -> dict:
    """What a run directory's recipe.json holds: the recipe's file by its absolute path (its relative
    paths, model.path and data.path, start from its folder: `weft export RUN` started in another folder
    than the run's must find that folder too), the overrides and the recipe."""
    source = recipe.source if recipe.source == "<memory>" else str(pathlib.Path(recipe.source).resolve())
    return {"source": source, "overrides": overrides, "recipe": recipe.raw}


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cmd_run(args) -> int:
    from weft.core.plan.planner import plan_recipe
    from weft.core.recipe import Recipe

    launcher = getattr(args, "launcher", None)  # a rank weft's launcher started: main() watches that launcher
    recipe = Recipe.from_toml(args.recipe, overrides=tuple(args.overrides))
    pm = plugin_manager_from_env()
    if args.overwrite and args.resume:
        raise WeftError("--overwrite starts over and --resume continues: give one", where="--overwrite")
    if _under_launcher():
        run_dir = args.run_dir or pathlib.Path("runs") / (
            f"{pathlib.Path(args.recipe).stem}-{os.environ.get('TORCHELASTIC_RUN_ID', 'torchrun')}")
        # weft's own launcher holds the lock for its ranks; under torchrun, rank 0 takes it.
        held = args.locked or os.environ.get("RANK") != "0"
        from weft.core.checkpoint.read import checkpoint_dirs
        from weft.core.run.launch import restarted

        # After a lost rank the launcher starts every rank again: they continue from the newest checkpoint.
        resume = args.resume or (restarted() and bool(checkpoint_dirs(run_dir)))
        if launcher is not None:  # in the lock before anything is written: a new run sees this rank
            join_run(run_dir, launcher_pid=launcher.launcher_pid, rank=launcher.rank)
        try:
            with contextlib.nullcontext() if held else run_lock(run_dir):
                if not held and not resume:  # under torchrun: rank 0, before any rank writes
                    _settle(run_dir, overwrite=args.overwrite)
                return _train(recipe, pm, run_dir=run_dir, resume=resume, launcher=launcher)
        except WeftError as error:
            if launcher is not None:  # weft's launcher says it, once (core/run/rank_errors.py)
                note(error, folder=run_dir, stem="run", rank=launcher.rank)
            raise
    nproc = args.nproc or recipe.parallel.nproc
    run_dir = _run_dir(args, recipe)
    if args.resume:
        from weft.core.checkpoint.read import checkpoint_dirs

        if not checkpoint_dirs(run_dir):  # before any rank starts
            raise WeftError(f"no checkpoint under {run_dir / 'checkpoints'} to resume from (checkpoints are written "
                            "every train.checkpoint_every steps and at the end)", where="--resume")
    # One run per run directory: the lock first (a busy directory is said at once), then
    # everything a user can get wrong, before any process starts.
    with run_lock(run_dir):
        plan_recipe(recipe, pm=pm, world_size=nproc)
        _check_inputs(recipe, pm)
        if not args.resume:
            _settle(run_dir, overwrite=args.overwrite)
        (run_dir / "recipe.json").write_text(json.dumps(recipe_record(recipe, args.overrides), indent=1, default=str))
        print(f"weft: run directory {run_dir}", file=sys.stderr)
        if nproc == 1:
            return _train(recipe, pm, run_dir=run_dir, resume=args.resume)
        from weft.core.run.launch import launch_local

        child_args = ["-m", "weft", "run", args.recipe, "--run-dir", str(run_dir), "--locked"]
        for override in args.overrides:
            child_args += ["--set", override]
        if args.resume:
            child_args.append("--resume")
        clear(folder=run_dir, stem="run")
        code = launch_local(nproc=nproc, args=child_args, run_dir=run_dir, max_restarts=args.max_restarts)
        error = noted(folder=run_dir, stem="run", code=code) if code != 0 else None
        if error is not None:
            raise error
        return code


def _settle(run_dir: pathlib.Path, *, overwrite: bool) -> None:
    aside = settle_previous_run(run_dir, overwrite=overwrite)
    if aside is not None:
        print(f"weft: --overwrite: the previous run of {run_dir} moved to {aside}", file=sys.stderr)


def _check_inputs(recipe: Recipe, pm: WeftPluginManager) -> None:
    if recipe.data.source == "jsonl":
        for key, path in recipe.data_files():
            if not path.exists():
                raise WeftError(f"{key} {str(path)!r} does not exist (relative to the recipe; with --set, to here)",
                                where=f"{recipe.source} ({key})")
    tokenized = recipe.data.source == "jsonl" or not recipe.data.tokens
    config, processor = pm.models.for_recipe(recipe).config(recipe)
    # A downloaded directory without a file the run reads: one message, not one error per rank.
    check_weight_files(recipe)
    check_processor_files(recipe, processor, needs=data_needs(recipe), vision=reads_images(config))
    if tokenized and processor is None:
        # Before any rank builds the model: a 7B preset has no tokenizer to read chat data with.
        raise WeftError(
            f"model.preset {recipe.model.preset!r} comes with no processor (tokenizer and image processor), which "
            f"data.source = {recipe.data.source!r} needs; set model.processor to a processor folder, or use "
            "data.source = 'synthetic' with data.tokens = N (long samples from the model's vocabulary, no tokenizer)",
            where=f"{recipe.source} (model.processor)")


def _run_dir(args, recipe) -> pathlib.Path:
    if args.run_dir is not None:
        return args.run_dir
    stem = pathlib.Path(args.recipe).stem
    if args.resume:
        runs = sorted(pathlib.Path("runs").glob(f"{stem}-*"))
        if not runs:
            raise WeftError(f"--resume: no earlier run of {stem!r} under runs/; give --run-dir", where="--resume")
        return runs[-1]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return pathlib.Path("runs") / f"{stem}-{stamp}"


def _train(recipe: Recipe, pm: WeftPluginManager, *, run_dir: pathlib.Path, resume: bool, launcher=None) -> int:
    from weft.core.train.loop import train

    run_dir.mkdir(parents=True, exist_ok=True)
    summary = train(recipe=recipe, pm=pm, run_dir=run_dir, resume=resume, console=True, launcher=launcher)
    if summary["status"] == "interrupted" and os.environ.get("RANK", "0") == "0":
        saved = summary["last_checkpoint"] or "none (train.checkpoint_every = -1)"
        print(f"weft: interrupted by {summary['reason']} after step {summary['last_step']}; checkpoint: {saved}; "
              "continue with --resume", file=sys.stderr)
    return EXIT_OK
