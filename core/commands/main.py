"""The `weft` command: its parser's commands dispatched (core/commands/parser.py), and the
handlers of plan, check, export and plugins. User errors print one paragraph and exit 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Sequence

from weft.core.commands import evaluate, generate, report
from weft.core.commands.parser import build_parser
from weft.core.commands.run import cmd_run
from weft.core.errors import EXIT_OK, EXIT_RUNTIME, WeftError
from weft.core.plugin_manager import plugin_manager_from_env


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.launcher_pid is not None:  # a rank weft's launcher started: first thing, it must not outlive it
            from weft.core.run.launcher_watch import LauncherWatch

            args.launcher = LauncherWatch(launcher_pid=args.launcher_pid,
                                          rank=int(os.environ.get("RANK", "0"))).start()
        return args.func(args)
    except WeftError as error:
        # Once per run, not once per rank (the others log it); a rank of weft's own launcher
        # that noted its message for the launcher leaves the saying to it (core/run/rank_errors.py).
        noted = getattr(error, "noted", False) and args.launcher_pid is not None
        if os.environ.get("RANK", "0") == "0" and not noted:
            if os.environ.get("WEFT_DEBUG", "") not in ("", "0") and error.__cause__ is not None:
                traceback.print_exception(error.__cause__)
            print(f"weft: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("weft: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    return build_parser(handlers={
        "run": cmd_run, "plan": _cmd_plan, "check": _cmd_check, "_check-worker": _cmd_check_worker,
        "eval": evaluate.cmd_eval, "generate": generate.cmd_generate, "report": report.cmd_report,
        "_eval-worker": evaluate.cmd_eval_worker, "_generate-worker": generate.cmd_generate_worker,
        "export": _cmd_export, "plugins": _cmd_plugins})


def _load(args) -> "object":
    from weft.core.recipe import Recipe

    return Recipe.from_toml(args.recipe, overrides=tuple(args.overrides))


# ---------------------------------------------------------------------------
# weft plan
# ---------------------------------------------------------------------------


def _cmd_plan(args) -> int:
    from weft.core.plan.planner import plan_recipe

    recipe = _load(args)
    if (warning := recipe.warmup_warning()) is not None:  # not an error: a short trial may keep its warmup
        print(f"weft: warning: {recipe.source} (train.warmup_steps): {warning}", file=sys.stderr)
    pm = plugin_manager_from_env()
    world_size = args.world_size or recipe.parallel.nproc
    plan, model = plan_recipe(recipe, pm=pm, world_size=world_size)
    from weft.core.train.rope_resolve import resolve_rope

    resolved = resolve_rope(recipe, plan=plan, pm=pm)
    if args.estimate:
        from weft.core.plan.estimate_view import estimate, render_estimate

        result = estimate(recipe, plan, model, gpu=args.gpu, host_gib=args.host_gib)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            render_estimate(result)
        return EXIT_OK
    family = pm.models.for_recipe(recipe)
    config = model.config if resolved is recipe else family.config(resolved)[0]
    rope = family.rope_summary(config, recipe=resolved)
    # What the batching strategy can tell of its data: the first step's images per SP
    # rank, and with --positions the largest position id of every sample.
    decision = plan.decision("batching")
    describe = pm.registry.get("batching", decision.strategy).describe
    report = describe(decision.params, recipe=recipe, plan=plan, model=model, family=family,
                      positions=args.positions) if describe else {}
    images, positions = report.get("vision_split", []), report.get("positions")
    if args.positions and positions is None:
        raise WeftError(f"batching strategy {decision.strategy!r} cannot describe its data's positions",
                        where="--positions")
    if args.json:
        extra = {"positions": positions} if positions else {}
        print(json.dumps(dict(plan.to_json(), model=family.name, vision_split=images, rope=rope, **extra), indent=1))
        return EXIT_OK
    from weft.core.plan.view import render_plan, render_positions, render_trainable, render_vision_split

    render_plan(plan, explain=args.explain, recipe=recipe, rope=rope)
    render_trainable(plan, model)
    root = plan.root().get("shard")
    inside = pm.registry.get("shard", root.strategy).describe if root is not None else None
    for line in (inside(root.params, recipe=recipe, plan=plan, model=model, family=family,
                        positions=False) if inside else {}).get("lines", []):
        print(line)
    if positions is not None:
        render_positions(positions)
    if images:
        render_vision_split(images)
    return EXIT_OK


# ---------------------------------------------------------------------------
# weft check
# ---------------------------------------------------------------------------


def _cmd_check(args) -> int:
    from weft.core.commands.check import run_check
    from weft.core.plan.view import render_check

    recipe = _load(args)
    pm = plugin_manager_from_env()
    world_size = args.world_size or recipe.parallel.nproc
    result = run_check(recipe, world_size=world_size, overrides=args.overrides, recipe_arg=args.recipe, pm=pm)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        render_check(result)
    return EXIT_OK if result["ok"] else EXIT_RUNTIME


def _cmd_check_worker(args) -> int:
    from weft.core.commands.check import worker

    worker(_load(args), out=args.out)
    return EXIT_OK


# ---------------------------------------------------------------------------
# weft export
# ---------------------------------------------------------------------------


def _cmd_export(args) -> int:
    from weft.core.commands.export import export

    checkpoint = export(args.run_dir, args.out_dir, step=args.step, pm=plugin_manager_from_env(), merge=args.merge,
                        overwrite=args.overwrite)
    print(f"weft: exported {checkpoint} to {args.out_dir}", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------------------
# weft plugins
# ---------------------------------------------------------------------------


def _cmd_plugins(args) -> int:
    from weft.core.plan.view import plugins_table

    pm = plugin_manager_from_env()
    table = plugins_table(pm)
    if args.json:
        print(json.dumps(table, indent=1, default=str))
    else:
        from weft.core.plan.view import render_plugins

        render_plugins(table)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
