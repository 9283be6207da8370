"""`weft eval RECIPE --data FILE.jsonl`: a dataset's loss and perplexity under the recipe's
plan, forward only.

The ranks run what training runs (the recipe's sharding, sequence parallelism, kernels,
autocast and loss) under torch.no_grad, over every sample of the file once: the batching
strategy is asked for one pass (``ctx.one_pass``) and pads the last round for ranks left
without a micro-batch with label-less copies. The loss is the mean over every label token
of the dataset, as one unsharded forward over each sample gives it; the weights are the
recipe's initial ones, or a weft run's checkpoint (``--run-dir``, any saving world size).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from weft.core.commands.rank_args import for_ranks, model_dir_recipe, recipe_from
from weft.core.errors import EXIT_OK, WeftError
from weft.core.recipe import Recipe


def run_eval(*, nproc: int, args: list[str]) -> dict:
    """Start ``nproc`` ranks of the hidden ``_eval-worker`` command; rank 0's result."""
    from weft.core.run.rank_job import launch_job

    return launch_job("eval", nproc=nproc, args=args)


def worker(recipe: Recipe, *, out: pathlib.Path, **options) -> None:
    from weft.core.commands.reference_eval import write_reference
    from weft.core.commands.task_eval import score_task
    from weft.core.run.rank_job import run_on_rank

    job = score_task if options.get("task") else write_reference if options.get("reference") else _evaluate
    run_on_rank(recipe, out=out, job=job, **options)


def _evaluate(recipe: Recipe, *, rank: int, world_size: int, local_rank: int, device_type: str,
              run_dir: pathlib.Path | None, step: int | None, max_batches: int = 0,
              adapter_dir: str | None = None) -> dict:
    from weft.core.infer.prepare_inference import prepare_inference
    from weft.core.mesh_spec import MESH_ORDER
    from weft.core.train.evaluation import forward_pass, held_out_recipe
    from weft.core.train.step import autocast_for

    pm, ctx, run, checkpoint = prepare_inference(recipe, rank=rank, world_size=world_size, local_rank=local_rank,
                                                 device_type=device_type, run_dir=run_dir, step=step, one_pass=True,
                                                 adapter_dir=adapter_dir)
    decision = run.plan.decision("batching")
    steps = pm.batching(decision=decision, recipe=held_out_recipe(recipe, data=recipe.data), plan=run.plan,
                        mesh=run.mesh, model=run.model, ctx=ctx)
    autocast = autocast_for(recipe.train.precision, device_type)
    done = forward_pass(run=run, rounds=steps, autocast=autocast, ctx=ctx, max_batches=max_batches)
    labels, tokens, batches, seconds = done["labels"], done["tokens"], done["micro_batches"], done["seconds"]
    if labels == 0:
        raise WeftError(f"no label tokens to evaluate in {recipe.data.path or 'the synthetic data'} "
                        f"({ctx.counters.get('skipped_samples', 0)} samples skipped)", where="--data")
    loss = done["loss_sum"] / labels
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "label_tokens": int(labels),
            "tokens": int(tokens), "micro_batches": int(batches), "seconds": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9), "skipped": dict(ctx.counters),
            "world_size": world_size, "mesh": dict(zip(MESH_ORDER, run.plan.mesh.shape)),
            "precision": recipe.train.precision, "checkpoint": checkpoint, "data": recipe.data.path,
            **done["stats"]}  # the objective's values beside the loss (dpo: rewards, preference accuracy)


def render(result: dict[str, Any]) -> str:
    """One paragraph for the terminal."""
    skipped = sum(v for k, v in result["skipped"].items() if k.startswith("skipped"))
    mesh = ", ".join(f"{k} {v}" for k, v in result["mesh"].items() if v > 1) or "one rank"
    preference = (f"; reward margin {result['reward_margin']:.4f}, preference accuracy "
                  f"{result['preference_accuracy']:.1%}" if "preference_accuracy" in result else "")
    return (f"loss {result['loss']:.6f}{preference}, perplexity {result['perplexity']:.4g} over "
            f"{result['label_tokens']:,} label "
            f"tokens ({result['micro_batches']} micro-batches, {result['tokens']:,} tokens, {skipped} samples "
            f"skipped); {result['tokens_per_s']:,.0f} tokens/s on {result['world_size']} rank(s) ({mesh}), "
            f"{result['precision']}" + (f"; weights from {result['checkpoint']}" if result["checkpoint"] else ""))


def cmd_eval(args) -> int:
    with model_dir_recipe(args):  # its errors name --model-dir DIR, not the recipe it writes
        return _eval(args)


def _eval(args) -> int:
    from weft.core.commands.reference_eval import reference_needs, reference_options, render_reference
    from weft.core.commands.task_eval import render_task, task_needs, task_options
    from weft.core.run.model_files import data_needs

    overrides = list(args.overrides)
    if args.data is not None and args.task is None:  # the loss's data, or the pairs of --reference
        if not args.data.is_file():
            raise WeftError(f"no such file: {args.data}; --data takes a JSONL chat file", where="--data")
        overrides += ["data.source=jsonl", f"data.path={args.data.resolve()}"]
    if args.reference is not None:  # the reference model's log-probabilities of the pairs, written
        options, needs, show = reference_options(args), reference_needs, render_reference
    elif args.task is not None:  # accuracy on a task's questions, in place of the loss
        options, needs, show = task_options(args), task_needs, render_task
    else:
        if args.results is not None or args.forced:
            flag = "--results" if args.results is not None else "--forced"
            raise WeftError(f"{flag} goes with --task (the answers of a task's questions); give --task too",
                            where=flag)
        options, needs, show = {"max_batches": args.max_batches or 0}, data_needs, render
    recipe, forwarded = for_ranks(args, overrides, options, needs=needs)
    result = run_eval(nproc=args.nproc or recipe.parallel.nproc, args=forwarded)
    print(json.dumps(result, indent=1) if args.json else f"weft eval: {show(result)}")
    return EXIT_OK


def cmd_eval_worker(args) -> int:
    worker(recipe_from(args.recipe, args.overrides), out=args.out, run_dir=args.run_dir, step=args.step,
           **json.loads(args.options))
    return EXIT_OK
