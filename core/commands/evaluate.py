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

import math
import pathlib
import time
from typing import Any

import torch
import torch.distributed as dist

from weft.core.errors import WeftError
from weft.core.recipe import Recipe


def run_eval(*, nproc: int, args: list[str]) -> dict:
    """Start ``nproc`` ranks of the hidden ``_eval-worker`` command; rank 0's result."""
    from weft.core.run.rank_job import launch_job

    return launch_job("eval", nproc=nproc, args=args)


def worker(recipe: Recipe, *, out: pathlib.Path, **options) -> None:
    from weft.core.run.rank_job import run_on_rank

    run_on_rank(recipe, out=out, job=_evaluate, **options)


def _evaluate(recipe: Recipe, *, rank: int, world_size: int, local_rank: int, device_type: str,
              run_dir: pathlib.Path | None, step: int | None, max_batches: int = 0,
              adapter_dir: str | None = None) -> dict:
    from weft.core.mesh_spec import MESH_ORDER
    from weft.core.run.rank_job import prepare_inference
    from weft.core.train.loss import IGNORE, targets
    from weft.core.train.step import autocast_for, run_micro_batches

    pm, ctx, run, checkpoint = prepare_inference(recipe, rank=rank, world_size=world_size, local_rank=local_rank,
                                                 device_type=device_type, run_dir=run_dir, step=step, one_pass=True,
                                                 adapter_dir=adapter_dir)
    decision = run.plan.decision("batching")
    steps = pm.call_first("weft_batching", decision=decision, recipe=recipe, plan=run.plan, mesh=run.mesh,
                          model=run.model, ctx=ctx)
    autocast = autocast_for(recipe.train.precision, device_type)
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    seen = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # this rank's tokens, micro-batches
    labels = 0.0  # global label tokens: run_micro_batches reduces them over every rank
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        for index, micro_batches in enumerate(steps):
            if max_batches and index >= max_batches:
                break  # every rank has the same number of rounds, so all stop together
            part, totals = run_micro_batches(model=run.model, micro_batches=micro_batches, split=run.split,
                                             keep_vision=run.keep_vision, autocast=autocast, ctx=ctx,
                                             fused=run.fused, backward=False)
            loss_sum += part.double()
            labels += float(totals[0])
            # Whole-sequence tokens of the micro-batches with labels (padding rounds have none);
            # every rank of an SP group sees the same micro-batch: divided by its size below.
            real = [mb for mb in micro_batches if bool((targets(mb) != IGNORE).any())]
            seen += torch.tensor([sum(mb["input_ids"].numel() for mb in real), len(real)], dtype=torch.float64,
                                 device=ctx.device)
    dist.all_reduce(loss_sum)
    dist.all_reduce(seen)
    seconds = time.perf_counter() - start
    sp = run.plan.mesh.sp
    tokens, batches = float(seen[0]) / sp, float(seen[1]) / sp
    if labels == 0:
        raise WeftError(f"no label tokens to evaluate in {recipe.data.path or 'the synthetic data'} "
                        f"({ctx.counters.get('skipped_samples', 0)} samples skipped)", where="--data")
    loss = float(loss_sum) / labels
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "label_tokens": int(labels),
            "tokens": int(tokens), "micro_batches": int(batches), "seconds": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9), "skipped": dict(ctx.counters),
            "world_size": world_size, "mesh": dict(zip(MESH_ORDER, run.plan.mesh.shape)),
            "precision": recipe.train.precision, "checkpoint": checkpoint, "data": recipe.data.path}


def render(result: dict[str, Any]) -> str:
    """One paragraph for the terminal."""
    skipped = sum(v for k, v in result["skipped"].items() if k.startswith("skipped"))
    mesh = ", ".join(f"{k} {v}" for k, v in result["mesh"].items() if v > 1) or "one rank"
    return (f"loss {result['loss']:.6f}, perplexity {result['perplexity']:.4g} over {result['label_tokens']:,} label "
            f"tokens ({result['micro_batches']} micro-batches, {result['tokens']:,} tokens, {skipped} samples "
            f"skipped); {result['tokens_per_s']:,.0f} tokens/s on {result['world_size']} rank(s) ({mesh}), "
            f"{result['precision']}" + (f"; weights from {result['checkpoint']}" if result["checkpoint"] else ""))
