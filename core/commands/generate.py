"""`weft generate RECIPE --prompt TEXT [--image PATH]...`: greedy or sampled decoding under
the recipe's plan. The options are checked here, before any rank starts; the ranks run the
decoding engine (core/infer/generate_one.py)."""

from __future__ import annotations

import json
import pathlib
import sys

from weft.core.commands.rank_args import for_ranks, model_dir_recipe, recipe_from
from weft.core.errors import EXIT_OK, WeftError
from weft.core.recipe import Recipe


def run_generate(*, nproc: int, args: list[str]) -> dict:
    """Start ``nproc`` ranks of the hidden ``_generate-worker`` command; rank 0's result."""
    from weft.core.run.rank_job import launch_job

    return launch_job("generate", nproc=nproc, args=args)


def worker(recipe: Recipe, *, out: pathlib.Path, **options) -> None:
    from weft.core.infer.generate_one import generate_on_rank
    from weft.core.run.rank_job import run_on_rank

    run_on_rank(recipe, out=out, job=generate_on_rank, **options)


def check_options(*, max_new_tokens: int, temperature: float, top_p: float,
                  profile: pathlib.Path | None = None) -> None:
    if profile is not None and profile.exists() and not profile.is_dir():
        raise WeftError(f"--profile names a folder to write decode_profile.json into; {profile} is a file",
                        where="--profile")
    if max_new_tokens < 1:
        raise WeftError(f"--max-new-tokens must be at least 1, got {max_new_tokens}", where="--max-new-tokens")
    if temperature < 0:
        raise WeftError(f"--temperature must be 0 (greedy) or above, got {temperature:g}", where="--temperature")
    if not 0 < top_p <= 1:
        raise WeftError(f"--top-p takes a value in (0, 1], got {top_p:g}", where="--top-p")


def cmd_generate(args) -> int:
    with model_dir_recipe(args):  # its errors name --model-dir DIR, not the recipe it writes
        return _generate(args)


def _generate(args) -> int:
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
               "fused_projections": args.fused_projections,
               "profile": str(args.profile.resolve()) if args.profile else None,
               **({"prompts": prompts} if prompts is not None else {}),
               **({"from_data": args.prompt_from_data} if (args.prompt_from_data or 1) > 1 else {})}
    from weft.core.run.model_files import prompt_needs

    # The prompt, and the decoding of what is generated, read the tokenizer and the image processor.
    recipe, forwarded = for_ranks(args, list(args.overrides), options, needs=lambda recipe: prompt_needs())
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
    worker(recipe_from(args.recipe, args.overrides), out=args.out, run_dir=args.run_dir, step=args.step,
           **json.loads(args.options))
    return EXIT_OK
