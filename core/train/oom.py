"""Out of GPU memory: one message that says where, how much, and which rule change would help.

Raised in place of torch's OutOfMemoryError (a page of allocator statistics) when a step
runs out: the step, this rank's micro-batch lengths, its allocated and reserved memory
against the device's, the last checkpoint (intact: a failed step writes nothing), and the
levers of the recipe that are not pulled yet, each with the rule or key that pulls it.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from weft.core.errors import EXIT_RUNTIME, WeftError
from weft.core.plan.estimate_inputs import units_of
from weft.core.plan.memory_advice import advice


class OutOfMemory(WeftError):
    exit_code = EXIT_RUNTIME


def out_of_memory(*, step: int, local_tokens: tuple[int, ...], ctx: Any, plan: Any) -> OutOfMemory:
    recipe = ctx.recipe
    where = f"step {step}, rank {ctx.rank}, micro-batches of {', '.join(f'{n:,}' for n in local_tokens) or '?'} tokens"
    memory = ""
    if ctx.device.type == "cuda":
        gib = 2**30
        total = torch.cuda.get_device_properties(ctx.device).total_memory / gib
        memory = (f"; {torch.cuda.memory_allocated(ctx.device) / gib:.1f} GiB allocated, "
                  f"{torch.cuda.memory_reserved(ctx.device) / gib:.1f} GiB reserved of {total:.1f} GiB")
    levers = advice(recipe, units_of(plan, None))
    saved = _last_checkpoint(ctx.run_dir)
    return OutOfMemory(
        f"out of GPU memory at {where}{memory}. What would help: " + "; ".join(levers)
        + (f". The last checkpoint ({saved}) is intact: fix the recipe, then --resume." if saved
           else ". No checkpoint was written yet."),
        where=recipe.source)


def _last_checkpoint(run_dir: pathlib.Path | None) -> str | None:
    from weft.core.run.checkpoint import checkpoint_dirs

    found = checkpoint_dirs(run_dir) if run_dir is not None else []
    return found[-1].name if found else None
