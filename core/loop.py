"""The training loop: one process's part of a run. Calls the hooks in the documented order.

Order: process group -> model (seeded) -> Plan -> mesh -> weft_shard -> weft_attention
per module -> optimizer -> resume -> weft_batching -> for each step: guard(step_start),
micro-batches (forward, loss / global label count, backward), weft_grad_sync,
guard(step_end), optimizer step, metrics, checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import pathlib
import sys
import time
import warnings
from typing import Any

import attrs
import torch
import torch.distributed as dist

from weft.core import checkpoint
from weft.core.attention_install import install_attention
from weft.core.context import RunContext
from weft.core.errors import WeftError
from weft.core.logging import run_logger
from weft.core.loss import label_count, targets, token_loss_sum
from weft.core.mesh import build_device_mesh, device_for
from weft.core.planner import plan_recipe
from weft.core.recipe import Recipe
from weft.core.registry import Verdict


@attrs.define(kw_only=True)
class StepState:
    """What guards see at the end of a step: global values, already reduced."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    tokens: int = 0
    consecutive_skips: int = 0
    error: BaseException | None = None
    # Per-run state a guard keeps between steps (a running mean, a counter), keyed
    # by the guard's strategy name; the loop hands the same dict to every step.
    memory: dict[str, Any] = attrs.field(factory=dict)


def init_process_group(recipe: Recipe) -> tuple[int, int, int, str]:
    """(rank, world_size, local_rank, device_type); a single process gets a one-rank group."""
    want = recipe.parallel.device
    device_type = "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"
    backend = recipe.parallel.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ:  # started by torchrun / the elastic launcher
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return dist.get_rank(), dist.get_world_size(), local_rank, device_type


def close_process_group(*, clean: bool) -> None:
    """Tear every process group down while the interpreter is still whole.

    ``clean``: this rank finished without an error, so every rank reaches this point;
    a barrier first keeps a fast rank from closing connections a slower peer's last
    collective still uses. After an error a one-rank group is still destroyed (a
    library caller may start another run); a multi-rank one is left alone, since the
    peers may never arrive and the launcher stops them.

    Models wrapped by FSDP and device meshes sit in reference cycles that hold
    sub-groups (and their Gloo work threads); left to the collector at interpreter
    exit, they are destroyed while modules are being cleared, which aborts the
    process now and then ("terminate called without an active exception"; seen once
    in about a hundred two-rank `weft check` runs on two busy cores). Collecting them
    here, before destroying the groups, avoids that.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        if not clean:
            return
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def train(*, recipe: Recipe, pm: Any, run_dir: pathlib.Path, resume: bool, console: bool) -> dict:
    rank, world_size, local_rank, device_type = init_process_group(recipe)
    device = device_for(device_type, local_rank)
    log = run_logger(run_dir=run_dir, rank=rank, console=console)
    ctx = RunContext(recipe=recipe, device=device, rank=rank, world_size=world_size, run_dir=run_dir, log=log)
    try:
        result = _train(recipe=recipe, pm=pm, ctx=ctx, resume=resume, console=console)
    except BaseException:
        close_process_group(clean=False)
        raise
    close_process_group(clean=True)
    return result


def _global_max(value: int, *, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def prepare_model(*, recipe: Recipe, pm: Any, ctx: RunContext) -> tuple[Any, Any, Any]:
    """Model (seeded, identical on every rank) -> Plan -> mesh -> weft_shard -> weft_attention."""
    from weft.plugins.models.build import build_model, load_weights, watch_positions

    # Weights from a directory: built on the meta device, sharded, then each rank loads
    # only its shards (no process ever holds the whole model). Presets are random-init
    # and small: built whole with the run's seed, so every rank starts identical.
    from_disk = recipe.model.path is not None
    model = build_model(recipe, device="meta" if from_disk else ctx.device, seed=recipe.train.seed)
    plan, _ = plan_recipe(recipe, registry=pm.registry, world_size=ctx.world_size, model=model)
    mesh = build_device_mesh(plan.mesh, device_type=ctx.device.type)
    ctx.log.info("run.start", world_size=ctx.world_size, mesh=dict(zip(("dp_replicate", "dp_shard", "ulysses", "ring"), plan.mesh.shape)),
                 params=sum(p.numel() for p in model.parameters()), device=str(ctx.device))
    pm.hook.weft_shard(model=model, plan=plan, mesh=mesh, ctx=ctx)
    if from_disk:
        load_weights(model, recipe, device=ctx.device, log=ctx.log)
    install_attention(model=model, plan=plan, mesh=mesh, ctx=ctx, pm=pm)
    ctx.positions = watch_positions(model, recipe=recipe, log=ctx.log)
    model.train()
    return model, plan, mesh


def _train(*, recipe: Recipe, pm: Any, ctx: RunContext, resume: bool, console: bool) -> dict:
    rank, log, run_dir = ctx.rank, ctx.log, ctx.run_dir
    t_start = time.perf_counter()
    model, plan, mesh = prepare_model(recipe=recipe, pm=pm, ctx=ctx)
    if rank == 0:
        (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.train.lr, betas=(recipe.train.beta1, recipe.train.beta2),
        weight_decay=recipe.train.weight_decay, foreach=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(recipe))
    if resume:
        found = checkpoint.checkpoint_dirs(run_dir)
        if not found:
            raise WeftError(f"--resume: no checkpoint under {run_dir / 'checkpoints'}", where="--resume")
        ctx.start_step = checkpoint.load(path=found[-1], model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
        log.info("checkpoint.loaded", path=str(found[-1]), step=ctx.start_step)

    steps = iter(pm.call_first("weft_batching", decision=plan.decision("batching"), recipe=recipe, plan=plan, mesh=mesh, model=model, ctx=ctx))
    autocast = (
        torch.autocast(ctx.device.type, dtype=torch.bfloat16) if recipe.train.precision == "bf16" else contextlib.nullcontext()
    )
    metrics_file = (run_dir / "metrics.jsonl").open("a") if rank == 0 else None
    state = StepState(step=ctx.start_step)
    totals = {"tokens": 0, "train_s": 0.0, "skipped_steps": 0}
    progress = _progress(console and rank == 0 and sys.stderr.isatty(), total=recipe.train.max_steps, start=ctx.start_step)
    final_loss = None
    with progress as bar:
        for step in range(ctx.start_step + 1, recipe.train.max_steps + 1):
            t0 = time.perf_counter()
            micro_batches = next(steps)
            if not micro_batches:
                raise WeftError(
                    f"batching strategy {plan.decision('batching').strategy!r} gave rank {rank} no micro-batch for step {step}; "
                    "every rank needs at least one (and the same number) per step", where="batching",
                )
            state = StepState(step=step, consecutive_skips=state.consecutive_skips, memory=state.memory)
            _verdict(pm, "step_start", state, plan, ctx)
            try:
                forward_backward(model=model, micro_batches=micro_batches, state=state, autocast=autocast, pm=pm, plan=plan, mesh=mesh, ctx=ctx)
            except Exception as error:
                # Guards see the error (diagnostics, alerts); the run then stops: after a
                # failed step the ranks' collectives may be out of step, so no verdict resumes it.
                state.error = error
                verdict = _verdict(pm, "error", state, plan, ctx)
                log.error("step.error", step=step, error=repr(error), verdict=verdict.action, guard=verdict.guard)
                raise
            ctx.positions.poll()  # after the step's own syncs: warns once if positions passed the rotary context
            verdict = _verdict(pm, "step_end", state, plan, ctx)
            if verdict.action == "abort":
                raise WeftError(f"guard {verdict.guard!r} stopped the run at step {step}: {verdict.reason}", where="guard")
            if verdict.action == "skip":
                optimizer.zero_grad(set_to_none=True)
                state.consecutive_skips += 1
                totals["skipped_steps"] += 1
                log.warning("step.skipped", step=step, guard=verdict.guard, reason=verdict.reason)
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.consecutive_skips = 0
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            dt = time.perf_counter() - t0
            totals["tokens"] += state.tokens
            totals["train_s"] += dt
            final_loss = state.loss
            row = {"step": step, "loss": state.loss, "tokens": state.tokens, "tokens_per_s": state.tokens / dt, "lr": lr,
                   "grad_norm": state.grad_norm, "step_s": dt, "skipped": verdict.action == "skip"}
            if ctx.device.type == "cuda":
                row["max_memory_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
            if metrics_file is not None:
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
            if step % recipe.train.log_every == 0 or step == recipe.train.max_steps:
                log.info("step.end", **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
            bar.advance(step, row)
            every = recipe.train.checkpoint_every
            if (every and step % every == 0) or step == recipe.train.max_steps or verdict.action == "checkpoint":
                path = checkpoint.save(run_dir=run_dir, step=step, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank, keep=recipe.train.keep_checkpoints)
                log.info("checkpoint.saved", step=step, path=str(path))
    summary = {
        "steps": recipe.train.max_steps,
        "start_step": ctx.start_step,
        "final_loss": final_loss,
        "tokens": totals["tokens"],
        "tokens_per_s": totals["tokens"] / totals["train_s"] if totals["train_s"] else 0.0,
        "skipped_samples": ctx.counters.get("skipped_samples", 0),
        "truncated_samples": ctx.counters.get("truncated_samples", 0),
        "skipped_steps": totals["skipped_steps"],
        "wall_s": time.perf_counter() - t_start,
        "world_size": ctx.world_size,
        # Over every rank's batches: how close the data came to the rotary context.
        "largest_position": _global_max(ctx.positions.largest, device=ctx.device),
        "rope_context": ctx.positions.context,
    }
    if rank == 0:
        metrics_file.close()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log.info("run.end", **summary)
    return summary


def forward_backward(*, model, micro_batches, state: StepState, autocast, pm, plan, mesh, ctx: RunContext) -> None:
    """Every micro-batch's forward and backward, then grad sync; fills state.loss/grad_norm/tokens."""
    # One collective for the step's divisor: label tokens over every rank, so the
    # loss equals the unsharded model's mean over the global batch.
    # Tokens are this rank's positions (its part of the sequence under SP).
    counts = torch.stack([sum(label_count(targets(mb)) for mb in micro_batches), torch.tensor(sum(targets(mb).numel() for mb in micro_batches))]).to(ctx.device, torch.float64)
    dist.all_reduce(counts)
    global_labels = counts[0].clamp(min=1)
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float32)
    # FSDP2: reduce-scatter gradients once, after the last micro-batch; earlier ones
    # accumulate unsharded gradients locally (less communication, more memory).
    sync = getattr(model, "set_requires_gradient_sync", None)
    for index, mb in enumerate(micro_batches):
        if sync is not None:
            sync(index == len(micro_batches) - 1)
        batch = {k: v.to(ctx.device, non_blocking=True) for k, v in mb.items()}
        target = targets(batch)
        batch.pop("labels", None)
        batch.pop("shift_labels", None)
        with autocast, warnings.catch_warnings():
            # FSDP2 warns that the root returned a view (transformers slices
            # logits); the loss only reads it, never updates it in place.
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            logits = model(**batch, use_cache=False).logits  # (B, S, V)
        part = token_loss_sum(logits, target)
        # Gradient reductions average over all world_size ranks (FSDP and
        # grad_sync alike); scaling by world_size turns that mean into the
        # sum of every rank's share of (global loss sum / global label count).
        (part * (ctx.world_size / global_labels)).backward()
        loss_sum += part.detach()
    grad_results = pm.hook.weft_grad_sync(model=model, plan=plan, mesh=mesh, ctx=ctx)
    grad_norm = dict(item for result in grad_results if result for item in result).get("grad_norm")
    dist.all_reduce(loss_sum)
    state.loss = float(loss_sum / global_labels)  # the step's one host sync
    state.grad_norm = float(grad_norm) if grad_norm is not None else None
    state.tokens = int(counts[1])


def _verdict(pm: Any, event: str, state: StepState, plan: Any, ctx: RunContext) -> Verdict:
    verdicts = [v for v in pm.hook.weft_guard(event=event, state=state, plan=plan, ctx=ctx) if v is not None]
    return Verdict.strongest(verdicts)


def _lr_lambda(recipe: Recipe):
    warmup, total, floor = recipe.train.warmup_steps, recipe.train.max_steps, recipe.train.min_lr_ratio

    def factor(step: int) -> float:
        # step counts completed optimizer steps: 0 for the first step.
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, step: int, row: dict) -> None:
        pass


class _RichProgress(_NoProgress):
    """A rich bar with step, loss, tokens/s and memory."""

    def __init__(self, total: int, start: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        return False

    def advance(self, step: int, row: dict) -> None:
        memory = f" mem {row['max_memory_gib']:.1f} GiB" if "max_memory_gib" in row else ""
        self.progress.update(self.task, completed=step, info=f"loss {row['loss']:.4f}  {row['tokens_per_s']:.0f} tok/s{memory}")


def _progress(enabled: bool, *, total: int, start: int):
    return _RichProgress(total, start) if enabled else _NoProgress()
