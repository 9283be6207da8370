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
    levers = _levers(recipe, plan)
    saved = _last_checkpoint(ctx.run_dir)
    return OutOfMemory(
        f"out of GPU memory at {where}{memory}. What would help: " + "; ".join(levers)
        + (f". The last checkpoint ({saved}) is intact: fix the recipe, then --resume." if saved
           else ". No checkpoint was written yet."),
        where=recipe.source)


def _levers(recipe: Any, plan: Any) -> list[str]:
    levers = []
    lighter = [(unit.info.path, unit.get("shard")) for unit in plan.modules_for("shard")
               if unit.info.kind == "unit" and unit.info.modality in ("text", "vision")
               and getattr(unit.get("shard").params, "checkpoint", "full") != "full"]
    if lighter:
        path, decision = lighter[0]
        levers.append(f'checkpoint = "full" in {_rule(decision)} (it gives {path} and {len(lighter) - 1} more '
                      f'layers "{decision.params.checkpoint}")')
    if recipe.train.loss != "fused":
        levers.append('train.loss = "fused" (the logits and their gradient never exist)')
    full = [unit for unit in plan.modules_for("shard", "fsdp2")
            if unit.get("shard").params.storage_dtype in (None, "float32")]
    if full:
        levers.append(f'storage_dtype = "bfloat16" in {_rule(full[0].get("shard"))} '
                      "(weights, gradients and AdamW states at half the bytes)")
    levers.append(f"parallel.ring or parallel.ulysses > 1 over more GPUs (now ring {recipe.parallel.ring}, "
                  f"ulysses {recipe.parallel.ulysses}: each rank holds 1/(ring x ulysses) of the sequence)")
    levers.append(f"a smaller train.micro_batch_tokens (now {recipe.train.micro_batch_tokens:,})")
    return levers


def _rule(decision: Any) -> str:
    """The rule to change: the recipe's own, or a new one where weft's default decided."""
    if pathlib.Path(decision.source.rsplit(":", 1)[0]).name == "defaults.toml":
        return f"a shard rule of your own (weft's default rule decides now: {decision.source})"
    return f"the shard rule at {decision.source}"


def _last_checkpoint(run_dir: pathlib.Path | None) -> str | None:
    from weft.core.checkpoint import checkpoint_dirs

    found = checkpoint_dirs(run_dir) if run_dir is not None else []
    return found[-1].name if found else None
