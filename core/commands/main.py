"""The `weft` command: run, plan, plugins. User errors print one paragraph and exit 2."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import traceback
from typing import Sequence

from weft.core.commands.infer import add_inference_commands
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
    parser = argparse.ArgumentParser(prog="weft",
                                     description="Plugin-based parallelism for long-sequence VLM training.")
    # Given by weft's own launcher to the ranks it starts (core/run/launch.py): they die with it.
    parser.add_argument("--launcher-pid", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train a recipe on N local ranks (or under torchrun)")
    run.add_argument("recipe", help="recipe TOML file")
    run.add_argument("--nproc", type=_positive, default=None,
                     help="local ranks to start (default: parallel.nproc of the recipe)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe key, e.g. train.max_steps=10")
    run.add_argument("--run-dir", type=pathlib.Path, default=None,
                     help="run directory (default runs/<recipe>-<timestamp>)")
    run.add_argument("--locked", action="store_true", help=argparse.SUPPRESS)  # set by weft's own launcher
    run.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="restart the ranks up to N times after one dies; they resume from the newest checkpoint")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest checkpoint of --run-dir (default: the newest run of this recipe)")
    run.set_defaults(func=cmd_run)

    plan = sub.add_parser("plan", help="show which strategy each module gets, without weights or processes")
    plan.add_argument("recipe")
    plan.add_argument("--world-size", type=_positive, default=None, help="ranks to plan for (default: parallel.nproc)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--explain", action="store_true", help="add the deciding rule's file:line")
    plan.add_argument("--json", action="store_true", help="print the Plan as JSON")
    plan.add_argument("--estimate", action="store_true",
                      help="per-rank GPU memory, host memory and step time predicted, the longest length that fits")
    plan.add_argument("--gpu", choices=("h200", "h100", "a100-80g"), default="h200",
                      help="with --estimate: the GPU kind (default h200)")
    plan.add_argument("--host-gib", type=float, default=None,
                      help="with --estimate: one host's memory (default 128 GiB per GPU, up to 8 GPUs)")
    plan.add_argument("--positions", action="store_true",
                      help="read the recipe's data: the largest position id per sample (mRoPE-aware) "
                           "and the YaRN factor it needs")
    plan.set_defaults(func=_cmd_plan)

    check = sub.add_parser("check", help="one batch: unsharded model vs the recipe's plan on N ranks (loss, gradients)")
    check.add_argument("recipe")
    check.add_argument("--world-size", type=_positive, default=None,
                       help="ranks for the plan (default: parallel.nproc)")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--json", action="store_true", help="print the comparison as JSON")
    check.set_defaults(func=_cmd_check)

    worker = sub.add_parser("_check-worker", help=argparse.SUPPRESS)
    worker.add_argument("recipe")
    worker.add_argument("--out", type=pathlib.Path, required=True)
    worker.add_argument("--set", dest="overrides", action="append", default=[])
    worker.set_defaults(func=_cmd_check_worker)

    add_inference_commands(sub, positive=_positive)

    export = sub.add_parser("export", help="write a run's newest checkpoint as a Hugging Face model directory")
    export.add_argument("run_dir", type=pathlib.Path)
    export.add_argument("out_dir", type=pathlib.Path)
    export.add_argument("--step", type=_positive, default=None,
                        help="export this step's checkpoint instead of the newest")
    export.add_argument("--merge", action="store_true",
                        help="a run with adapters: fold them into the base's weights and write a plain model "
                             "(default: the adapters' own directory, PEFT's adapter_config.json and "
                             "adapter_model.safetensors)")
    export.set_defaults(func=_cmd_export)

    plugins = sub.add_parser("plugins", help="hook points, plugins and their strategies")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=_cmd_plugins)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _load(args) -> "object":
    from weft.core.recipe import Recipe

    return Recipe.from_toml(args.recipe, overrides=tuple(args.overrides))


# ---------------------------------------------------------------------------
# weft plan
# ---------------------------------------------------------------------------


def _cmd_plan(args) -> int:
    from weft.core.plan.planner import plan_recipe

    recipe = _load(args)
    pm = plugin_manager_from_env()
    world_size = args.world_size or recipe.parallel.nproc
    plan, model = plan_recipe(recipe, pm=pm, world_size=world_size)
    from weft.core.train.rope import resolve_rope

    resolved = resolve_rope(recipe, plan=plan, pm=pm)
    if args.estimate:
        from weft.core.plan.estimate_view import estimate, render_estimate

        result = estimate(recipe, plan, model, gpu=args.gpu, host_gib=args.host_gib)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            render_estimate(result)
        return EXIT_OK
    adapter = pm.models.for_recipe(recipe)
    config = model.config if resolved is recipe else adapter.config(resolved)[0]
    rope = adapter.rope_summary(config, recipe=resolved)
    # What the batching strategy can tell of its data: the first step's images per SP
    # rank, and with --positions the largest position id of every sample.
    decision = plan.decision("batching")
    describe = pm.registry.get("batching", decision.strategy).describe
    report = describe(decision.params, recipe=recipe, plan=plan, model=model, adapter=adapter,
                      positions=args.positions) if describe else {}
    images, positions = report.get("vision_split", []), report.get("positions")
    if args.positions and positions is None:
        raise WeftError(f"batching strategy {decision.strategy!r} cannot describe its data's positions",
                        where="--positions")
    if args.json:
        extra = {"positions": positions} if positions else {}
        print(json.dumps(dict(plan.to_json(), model=adapter.name, vision_split=images, rope=rope, **extra), indent=1))
        return EXIT_OK
    from weft.core.plan.view import render_plan, render_positions, render_trainable, render_vision_split

    render_plan(plan, explain=args.explain, recipe=recipe, rope=rope)
    render_trainable(plan, model)
    root = plan.root().get("shard")
    inside = pm.registry.get("shard", root.strategy).describe if root is not None else None
    for line in (inside(root.params, recipe=recipe, plan=plan, model=model, adapter=adapter,
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

    checkpoint = export(args.run_dir, args.out_dir, step=args.step, pm=plugin_manager_from_env(), merge=args.merge)
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
