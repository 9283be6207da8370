"""The handlers of the `weft` commands beside training: eval (a dataset's loss), generate
(decoding), report (a run's curves); their flags are in core/commands/parser.py."""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
from typing import Any, Callable

from weft.core.errors import EXIT_OK, WeftError


def _recipe(path: str, overrides: list[str]) -> Any:
    from weft.core.recipe import Recipe

    return Recipe.from_toml(path, overrides=tuple(overrides))


def _model_dir_recipe(args: Any, folder: str) -> None:
    """``--model-dir DIR``: a recipe of just ``model.path = DIR``, written into ``folder`` (which
    outlives the ranks), becomes the command's recipe."""
    if (args.recipe is None) == (args.model_dir is None):
        raise WeftError("give a recipe or --model-dir, not both" if args.recipe else "give a recipe or --model-dir",
                        where="--model-dir")
    if args.model_dir is None:
        return
    if not (args.model_dir / "config.json").is_file():
        raise WeftError(f"{args.model_dir} has no config.json; --model-dir takes a Hugging Face model directory",
                        where="--model-dir")
    recipe = pathlib.Path(folder) / "model-dir.toml"
    recipe.write_text(f"[model]\npath = {json.dumps(str(args.model_dir.resolve()))}\n")
    args.recipe = str(recipe)


def _forwarded(args: Any, overrides: list[str], options: dict, *,
               needs: Callable[[Any], dict]) -> tuple[Any, list[str]]:
    """Check what the ranks need, then their arguments: the recipe is read here first, so
    its mistakes are messages before any rank starts. ``needs(recipe)``: what the command
    reads from the processor folder (core/run/model_files.py)."""
    if args.step is not None and args.run_dir is None:
        raise WeftError("--step picks a checkpoint of --run-dir; give --run-dir too", where="--step")
    if args.run_dir is not None and not (args.run_dir / "checkpoints").is_dir():
        raise WeftError(f"{args.run_dir} has no checkpoints/ folder; --run-dir takes a weft run directory",
                        where="--run-dir")
    if args.adapter is not None:
        _check_adapter_dir(args)
        options = {**options, "adapter_dir": str(args.adapter.resolve())}
    recipe = _recipe(args.recipe, overrides)
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.run.model_files import check_processor_files, check_weight_files

    processor = plugin_manager_from_env().models.for_recipe(recipe).config(recipe)[1]
    check_processor_files(recipe, processor, needs=needs(recipe))
    check_weight_files(recipe)  # read by every rank, with --run-dir too (its checkpoint's weights replace them)
    forwarded = [args.recipe, *(a for o in overrides for a in ("--set", o)), "--options", json.dumps(options)]
    if args.run_dir is not None:
        forwarded += ["--run-dir", str(args.run_dir.resolve())] + (["--step", str(args.step)] if args.step else [])
    return recipe, forwarded


def _check_adapter_dir(args: Any) -> None:
    if args.run_dir is not None:
        raise WeftError("--adapter gives the adapters' weights, --run-dir a run's: give one of them", where="--adapter")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (args.adapter / name).is_file():
            raise WeftError(f"{args.adapter} has no {name}; --adapter takes a PEFT adapter directory "
                            "(adapter_config.json and adapter_model.safetensors, as `weft export` writes for a LoRA "
                            "run)", where="--adapter")


def cmd_eval(args) -> int:
    with tempfile.TemporaryDirectory() as folder:
        _model_dir_recipe(args, folder)
        return _eval(args)


def _eval(args) -> int:
    from weft.core.commands.evaluate import render, run_eval
    from weft.core.commands.task_eval import render_task, task_needs, task_options
    from weft.core.run.model_files import data_needs

    overrides = list(args.overrides)
    if args.task is not None:  # accuracy on a task's questions, in place of the loss
        options, needs, render = task_options(args), task_needs, render_task
    else:
        if args.results is not None:
            raise WeftError("--results holds --task's answers; give --task too", where="--results")
        if args.data is not None:
            if not args.data.is_file():
                raise WeftError(f"no such file: {args.data}; --data takes a JSONL chat file", where="--data")
            overrides += ["data.source=jsonl", f"data.path={args.data.resolve()}"]
        options, needs = {"max_batches": args.max_batches or 0}, data_needs
    recipe, forwarded = _forwarded(args, overrides, options, needs=needs)
    result = run_eval(nproc=args.nproc or recipe.parallel.nproc, args=forwarded)
    print(json.dumps(result, indent=1) if args.json else f"weft eval: {render(result)}")
    return EXIT_OK


def cmd_eval_worker(args) -> int:
    from weft.core.commands.evaluate import worker

    worker(_recipe(args.recipe, args.overrides), out=args.out, run_dir=args.run_dir, step=args.step,
           **json.loads(args.options))
    return EXIT_OK


def cmd_generate(args) -> int:
    with tempfile.TemporaryDirectory() as folder:
        _model_dir_recipe(args, folder)
        return _generate(args)


def _generate(args) -> int:
    from weft.core.commands.generate import check_options, run_generate
    from weft.core.commands.prompt_file import read_prompt_file

    check_options(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  profile=args.profile)  # each a message naming its flag, before any rank starts
    for flag, paths, kind in (("--image", args.images, "an image"), ("--video", args.videos, "a video")):
        for path in paths:
            if not path.is_file():
                raise WeftError(f"no such file: {path}; {flag} takes {kind} file", where=flag)
        if args.prompt_from_data and paths:
            raise WeftError(f"{flag} goes with --prompt; --prompt-from-data takes the data's own", where=flag)
    if args.prompt_file is not None and (args.images or args.videos):
        raise WeftError("--image and --video go with --prompt; a --prompt-file line names its own", where="--image")
    prompts = read_prompt_file(args.prompt_file) if args.prompt_file is not None else None
    options = {"prompt": args.prompt, "images": [str(p.resolve()) for p in args.images],
               "videos": [str(p.resolve()) for p in args.videos],
               "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
               "seed": args.seed, "stream": not args.json, "warmup": args.warmup, "cuda_graph": args.cuda_graph,
               "profile": str(args.profile.resolve()) if args.profile else None,
               **({"prompts": prompts} if prompts is not None else {}),
               **({"from_data": args.prompt_from_data} if (args.prompt_from_data or 1) > 1 else {})}
    from weft.core.run.model_files import prompt_needs

    # The prompt, and the decoding of what is generated, read the tokenizer and the image processor.
    recipe, forwarded = _forwarded(args, list(args.overrides), options, needs=lambda recipe: prompt_needs())
    nproc = args.nproc or recipe.parallel.nproc
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env

    # The plan here first: its mistakes (a cache that cannot take the mesh, ...) are exit-2
    # messages before any rank starts.
    dp = plan_recipe(recipe, pm=plugin_manager_from_env(), world_size=nproc)[0].mesh.dp
    if args.prompt_from_data:
        if dp > 1:
            raise WeftError(f"--prompt-from-data gives every rank one prompt, but the plan has {dp} data-parallel "
                            "groups; give the ranks to sequence parallelism (parallel.ring / parallel.ulysses)",
                            where="--prompt-from-data")
    batched = prompts is not None or (args.prompt_from_data or 1) > 1
    flag = "--prompt-file" if prompts is not None else "--prompt-from-data"
    if batched and nproc != 1:
        raise WeftError(f"{flag} decodes its prompts together on one process; got {nproc} ranks (--nproc 1)",
                        where=flag)
    result = run_generate(nproc=nproc, args=forwarded)
    if args.json:
        print(json.dumps(result, indent=1))
    elif batched:
        for index, answer in enumerate(result["answers"]):
            print(f"[{index}] {answer['text']}")
        print(f"weft generate: {len(result['answers'])} prompts ({sum(result['prompt_tokens']):,} tokens) decoded "
              "together; "
              f"prefill {result['prefill_tokens_per_s']:,.0f} tokens/s, decode {result['decode_ms_per_step']:.1f} "
              f"ms a step, {result['decode_tokens_per_s']:,.0f} tokens/s in all", file=sys.stderr)
    else:
        print()  # after the streamed text
        per_rank = ", ".join(f"{b / 2**20:.2f}" for b in result["cache_bytes_per_rank"])
        print(f"weft generate: {len(result['tokens'])} tokens after a {result['prompt_tokens']}-token prompt; "
              f"prefill {result['prefill_tokens_per_s']:,.0f} tokens/s, decode {result['decode_ms_per_token']:.1f} "
              f"ms/token{_steady(result)}; {result['cache']} MiB per rank: {per_rank}", file=sys.stderr)
    return EXIT_OK


def _steady(result: dict) -> str:
    """The replayed graph's ms a token and the step's compilation, where they apply."""
    parts = [f"{result['graph_ms_per_token']:.1f} ms/token replayed"] if result.get("graph_ms_per_token") else []
    if result.get("step_compile_s"):
        parts.append(f"step compiled in {result['step_compile_s']:.1f} s")
    elif result.get("first_step_s"):
        parts.append(f"first step {result['first_step_s']:.1f} s")
    if result.get("step_graph_breaks"):  # the step did not trace whole: its speed is not the compiled one's
        parts.append(f"{result['step_graph_breaks']} graph breaks, the first: {result['step_graph_break']}")
    return f" ({', '.join(parts)})" if parts else ""


def cmd_generate_worker(args) -> int:
    from weft.core.commands.generate import worker

    worker(_recipe(args.recipe, args.overrides), out=args.out, run_dir=args.run_dir, step=args.step,
           **json.loads(args.options))
    return EXIT_OK


def cmd_report(args) -> int:
    from weft.core.commands.report import plot, read_run, summary_lines

    out = args.out or args.run_dirs[0] / "report.png"
    if out.suffix.lower() not in (".png", ".html"):
        raise WeftError(f"--out {out}: the report is written as .png or .html", where="--out")
    runs = [read_run(run_dir) for run_dir in args.run_dirs]
    for line in summary_lines(runs):
        print(line)
    print(f"weft report: {plot(runs, out)}", file=sys.stderr)
    return EXIT_OK
