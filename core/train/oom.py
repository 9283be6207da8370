"""Out of GPU memory: one message that says where, how much, and which rule change would help.

Raised in place of torch's OutOfMemoryError (a page of allocator statistics) when a step
runs out: the step, this rank's micro-batch lengths, its allocated and reserved memory
against the device's, the last checkpoint (intact: a failed step writes nothing), and the
levers of the recipe that are not pulled yet, each with the rule or key that pulls it. The
held-out pass (``[eval]``, `weft eval`) has its own levers: its micro-batches, how often it runs.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

import torch

from weft.core.errors import EXIT_RUNTIME, WeftError
from weft.core.plan.estimate_inputs import units_of
from weft.core.plan.memory_advice import advice

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.recipe.rule_engine import Plan


class OutOfMemory(WeftError):
    exit_code = EXIT_RUNTIME


def out_of_memory(*, step: int, local_tokens: tuple[int, ...], ctx: RunContext, plan: Plan) -> OutOfMemory:
    recipe = ctx.recipe
    where = f"step {step}, rank {ctx.rank}, micro-batches of {', '.join(f'{n:,}' for n in local_tokens) or '?'} tokens"
    return OutOfMemory(f"out of GPU memory at {where}{_memory(ctx)}. What would help: "
                       + "; ".join(advice(recipe, units_of(plan, None))) + _intact(ctx.run_dir), where=recipe.source)


def eval_out_of_memory(*, after_step: int | None, local_tokens: tuple[int, ...], ctx: RunContext) -> OutOfMemory:
    """The held-out pass ran out: which pass, the levers of evaluation first, then the loss's."""
    recipe = ctx.recipe
    budget = recipe.eval.micro_batch_tokens or recipe.train.micro_batch_tokens
    longest = max(local_tokens, default=0)
    levers = [f"eval.micro_batch_tokens = {max(16, longest // 2 or budget // 2)} (now {budget}: held-out micro-batches "
              "of fewer tokens; longer samples are skipped)"]
    if recipe.train.loss != "fused":
        levers.append('train.loss = "fused" (the logits never exist, in training and evaluation)')
    if after_step is not None:
        levers.append(f"eval.every = {recipe.eval.every * 2} or 0 (now {recipe.eval.every}), then `weft eval "
                      f"{recipe.source} --run-dir RUN --step N` on the checkpoints: a process of its own, without the "
                      "run's gradients and optimizer states")
    where = (f"the held-out pass ([eval]) after step {after_step}" if after_step is not None else "`weft eval`") + \
        f", rank {ctx.rank}, micro-batches of {', '.join(f'{n:,}' for n in local_tokens) or '?'} tokens"
    return OutOfMemory(f"out of GPU memory in {where}{_memory(ctx)}. What would help: " + "; ".join(levers)
                       + (_intact(ctx.run_dir) if after_step is not None else "."), where=f"{recipe.source} (eval)")


def _memory(ctx: RunContext) -> str:
    if ctx.device.type != "cuda":
        return ""
    gib = 2**30
    total = torch.cuda.get_device_properties(ctx.device).total_memory / gib
    return (f"; {torch.cuda.memory_allocated(ctx.device) / gib:.1f} GiB allocated, "
            f"{torch.cuda.memory_reserved(ctx.device) / gib:.1f} GiB reserved of {total:.1f} GiB")


def _intact(run_dir: pathlib.Path | None) -> str:
    saved = _last_checkpoint(run_dir)
    return (f". The last checkpoint ({saved}) is intact: fix the recipe, then --resume." if saved
            else ". No checkpoint was written yet.")


def _last_checkpoint(run_dir: pathlib.Path | None) -> str | None:
    from weft.core.checkpoint.read import checkpoint_dirs

    found = checkpoint_dirs(run_dir) if run_dir is not None else []
    return found[-1].name if found else None
