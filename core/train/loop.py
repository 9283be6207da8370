"""The training loop: one process's part of a run. Calls the hooks in the documented order.

Order: process group -> prepare (family, model, Plan, mesh, weft_shard, weights,
weft_attention, sequence split) -> optimizer -> resume -> weft_batching -> for each
step: guard(step_start), micro-batches (forward, loss / global label count, backward),
weft_grad_sync, guard(step_end), optimizer step, the held-out loss when due ([eval]), metrics,
checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import pathlib
import resource
import sys
import threading
import time
from typing import Any

import attrs
import torch

from weft.core.context import RunContext, StepState
from weft.core.errors import GuardAbort, WeftError
from weft.core.mesh import device_for
from weft.core.plugin_manager import WeftPluginManager
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import Plan
from weft.core.registry import Verdict
from weft.core.run import checkpoint
from weft.core.run.end import Ending, trim_metrics
from weft.core.run.interrupt import StopRequest
from weft.core.run.logging import run_logger
from weft.core.run.peer_watch import PeerWatch, peers_lost, watch_peers
from weft.core.run.process_group import close_process_group, init_process_group
from weft.core.run.progress import progress_bar
from weft.core.train.evaluation import HeldOut
from weft.core.train.oom import out_of_memory
from weft.core.train.optimizer_setup import advance_schedule, make_optimizer, state_gib
from weft.core.train.prepare import Prepared, prepare_model
from weft.core.train.step import autocast_for, finish_step, run_micro_batches
from weft.core.train.timing import PhaseTimer


def train(*, recipe: Recipe, pm: WeftPluginManager, run_dir: pathlib.Path, resume: bool, console: bool,
          launcher: Any = None) -> dict:
    """``launcher``: the LauncherWatch of a rank weft's launcher started (core/run/launcher_watch.py)."""
    rank, world_size, local_rank, device_type, store = init_process_group(recipe)
    device = device_for(device_type, local_rank)
    log = run_logger(run_dir=run_dir, rank=rank, console=console)
    ctx = RunContext(recipe=recipe, device=device, rank=rank, world_size=world_size, run_dir=run_dir, log=log)
    stop = StopRequest()
    if threading.current_thread() is threading.main_thread():
        stop.install()
    ending = Ending(t_start=time.perf_counter())
    watch = watch_peers(store=store, recipe=recipe, ctx=ctx, ending=ending)
    if launcher is not None:
        launcher.attach(recipe=recipe, ctx=ctx, ending=ending)  # its death from now on recorded as the ending
    try:
        result = _train(recipe=recipe, pm=pm, ctx=ctx, resume=resume, console=console, stop=stop, ending=ending,
                        watch=watch)
    except BaseException as error:
        watch.step_finished()  # ended, by this error: the watch must not also time the step out
        lost = peers_lost(error, watch, ctx=ctx)  # a collective failed because a peer stopped: name it
        with contextlib.suppress(Exception):  # recording the ending must never hide the error itself
            ending.record(recipe, ctx, error=lost or error)
        watch.stop()
        close_process_group(clean=False)
        if lost is not None:
            raise lost from error
        raise
    finally:
        stop.restore()
    watch.stop()
    close_process_group(clean=True)
    return result


def _train(*, recipe: Recipe, pm: WeftPluginManager, ctx: RunContext, resume: bool, console: bool, stop: StopRequest,
           ending: Ending, watch: PeerWatch) -> dict:
    run = prepare_model(recipe=recipe, pm=pm, ctx=ctx)
    ctx = run.ctx
    recipe = ctx.recipe  # as the plan resolved it
    if ctx.rank == 0:
        (ctx.run_dir / "plan.json").write_text(json.dumps(run.plan.to_json(), indent=1))
    decision = run.plan.decision("batching")

    def batching():
        return pm.batching(decision=decision, recipe=recipe, plan=run.plan, mesh=run.mesh, model=run.model, ctx=ctx)

    counted = None
    if recipe.train.epochs:  # the steps of the epochs, counted from the data before the schedule is made
        counted = batching()
        recipe = epoch_steps(recipe, counted, strategy=decision.strategy, ctx=ctx)
        ctx = attrs.evolve(ctx, recipe=recipe)
    optimizer, scheduler = make_optimizer(recipe, run.model, plan=run.plan, pm=pm, ctx=ctx)
    ctx.state.optimizer = optimizer
    if resume:
        ctx.state.start_step = checkpoint.resume(ctx, model=run.model, optimizer=optimizer, scheduler=scheduler)
        if ctx.rank == 0:
            trim_metrics(ctx.run_dir / "metrics.jsonl", last_step=ctx.start_step)
    steps = iter(counted if counted is not None else batching())
    if not resume:
        # Start-up may draw from torch's generators a varying amount; the steps draw from a stream
        # the seed fixes (stochastic rounding repeats from run to run and agrees across replicas).
        # A resumed run continues the stream its checkpoint saved.
        torch.manual_seed(recipe.train.seed)
    autocast = autocast_for(recipe.train.precision, ctx.device.type)
    held_out = HeldOut(recipe=recipe, run=run, pm=pm, ctx=ctx, autocast=autocast) if recipe.eval.every else None
    totals = ending.totals
    if recipe.eval.keep_best and resume:
        ending.best = checkpoint.best(ctx.run_dir)  # the best so far, before the checkpoint resumed from
    state = StepState(step=ctx.start_step, memory=ctx.plugin_state)  # one per run; begin() at each step
    # Each metrics row goes to the run's metrics sinks (weft_metrics: metrics.jsonl by default), on rank 0.
    metrics = functools.partial(pm.metrics, event="step", plan=run.plan, ctx=ctx) if ctx.rank == 0 else None
    bar_on = console and ctx.rank == 0 and sys.stderr.isatty()
    with progress_bar(bar_on, total=recipe.train.max_steps, start=ctx.start_step) as bar:
        for step in range(ctx.start_step + 1, recipe.train.max_steps + 1):
            state.begin(step)
            watch.step_started(step)
            try:
                row, verdict = _one_step(run=run, steps=steps, state=state, optimizer=optimizer,
                                         scheduler=scheduler, autocast=autocast, pm=pm, ctx=ctx, totals=totals)
            except GuardAbort as abort:
                # The step ran (its row says aborted) but took no optimizer step: the last good state is the one before.
                ending.aborted_step, ending.last_step = step, step - 1
                _aborted(abort, state=state, metrics=metrics, run=run, optimizer=optimizer, scheduler=scheduler,
                         ctx=ctx, ending=ending)
                raise
            except torch.OutOfMemoryError as error:
                raise out_of_memory(step=step, local_tokens=state.local_tokens, ctx=ctx, plan=run.plan) from error
            watch.step_finished()
            if held_out is not None and held_out.due(step):
                row.update(held_out(step=step))  # eval_loss in the step's row: every metrics sink gets it
            if metrics is not None:
                metrics(row=row)
            if step % recipe.train.log_every == 0 or step == recipe.train.max_steps:
                ctx.log.info("step.end", **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
            bar.advance(step, row)
            ending.last_step, ending.loss = step, state.loss
            interrupted = stop.agreed(ctx.device)
            if _checkpoint_due(recipe.train.checkpoint_every, step=step, last=recipe.train.max_steps, verdict=verdict,
                               interrupted=interrupted):
                path = checkpoint.save(run_dir=ctx.run_dir, step=step, model=run.model, optimizer=optimizer,
                                       scheduler=scheduler, rank=ctx.rank, keep=recipe.train.keep_checkpoints,
                                       positions=ctx.positions)
                ctx.log.info("checkpoint.saved", step=step, path=str(path))
                ending.checkpoint = path.name
                metric = _BEST_BY[recipe.eval.best_by]
                if recipe.eval.keep_best and _better(row.get(metric), than=ending.best, metric=metric):
                    ending.best = checkpoint.mark_best(ctx.run_dir, step=step, metric=metric, value=row[metric],
                                                       rank=ctx.rank, keep=recipe.train.keep_checkpoints)
                    ctx.log.info("checkpoint.best", **ending.best)
            if interrupted:
                ending.status, ending.reason = "interrupted", f"{stop.signal or 'a signal to another rank'}"
                break
    summary = ending.record(recipe, ctx, positions=True)
    if ctx.rank == 0:
        pm.metrics(event="end", row=summary, plan=run.plan, ctx=ctx)
    return summary


def epoch_steps(recipe: Recipe, steps: Any, *, strategy: str, ctx: RunContext) -> Recipe:
    """The recipe with ``train.max_steps`` = the steps of ``train.epochs`` epochs: ``len()`` of
    the batching's iterable (the data read to count them)."""
    if "max_steps" in recipe.raw.get("train", {}):
        raise WeftError("train.epochs and train.max_steps both set: the epochs count the steps; drop one",
                        where=f"{recipe.source} (train.epochs)")
    try:
        total = len(steps)
    except TypeError:
        raise WeftError(f"batching strategy {strategy!r} does not count its steps (its iterable has no len()), "
                        "which train.epochs needs; set train.max_steps instead", where=f"{recipe.source} (train.epochs)"
                        ) from None
    ctx.log.info("data.epochs", epochs=recipe.train.epochs, steps=total)
    return attrs.evolve(recipe, train=attrs.evolve(recipe.train, max_steps=total))


def _one_step(*, run: Prepared, steps, state: StepState, optimizer, scheduler, autocast, pm: WeftPluginManager,
              ctx: RunContext, totals: dict) -> tuple[dict, Verdict]:
    """Guards, forward/backward, grad sync, optimizer: the step's metrics row and verdict."""
    t0 = time.perf_counter()
    timer = PhaseTimer(ctx.device)
    micro_batches = next(steps)
    state.local_tokens = tuple(int(mb["input_ids"].numel()) for mb in micro_batches if "input_ids" in mb)
    if not micro_batches:
        raise WeftError(
            f"batching strategy {run.plan.decision('batching').strategy!r} gave rank {ctx.rank} no micro-batch "
            f"for step {state.step}; every rank needs at least one (and the same number) per step",
            where="batching",
        )
    _verdict(pm, "step_start", state, run.plan, ctx)
    try:
        loss_sum, counts = run_micro_batches(model=run.model, micro_batches=micro_batches, split=run.split,
                                             keep_vision=run.keep_vision, autocast=autocast, ctx=ctx,
                                             fused=run.fused, objective=run.objective, timer=timer)
        finish_step(pm=pm, model=run.model, plan=run.plan, mesh=run.mesh, ctx=ctx, state=state, loss_sum=loss_sum,
                    totals=counts, objective=run.objective)
    except Exception as error:
        # Guards see the error (diagnostics, alerts); the run then stops: after a
        # failed step the ranks' collectives may be out of step, so no verdict resumes it.
        state.error = error
        verdict = _verdict(pm, "error", state, run.plan, ctx)
        ctx.log.error("step.error", step=state.step, error=repr(error), verdict=verdict.action, guard=verdict.guard)
        raise
    ctx.positions.poll()  # after the step's own syncs: warns once if positions passed the rotary context
    verdict = _verdict(pm, "step_end", state, run.plan, ctx)
    if verdict.action == "abort":
        raise GuardAbort(f"guard {verdict.guard!r} stopped the run at step {state.step}: {verdict.reason}",
                         where="guard")
    if verdict.action == "skip":
        state.consecutive_skips += 1
        totals["skipped_steps"] += 1
        ctx.log.warning("step.skipped", step=state.step, guard=verdict.guard, reason=verdict.reason)
    else:
        timer.start("optimizer")
        optimizer.step()
        timer.stop("optimizer")
        state.consecutive_skips = 0
    if verdict.action != "skip" and "state_gib" not in totals:  # once, while gradients and states both exist
        totals["state_gib"] = state_gib(run.model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    lr = float(scheduler.get_last_lr()[0])  # a tensor under torchao (a CPU one: no sync)
    advance_schedule(scheduler, skipped=verdict.action == "skip")
    # Waits for the optimizer's kernels (the events' last mark), so dt holds the whole step.
    phases = timer.seconds()  # forward_s, backward_s, optimizer_s
    dt = time.perf_counter() - t0
    totals["tokens"] += state.tokens
    totals["train_s"] += dt
    row = {"step": state.step, "loss": state.loss, "tokens": state.tokens, "tokens_per_s": state.tokens / dt, "lr": lr,
           "grad_norm": state.grad_norm, "step_s": dt, "skipped": verdict.action == "skip", **state.stats}
    row.update({k: round(v, 6) for k, v in phases.items()})
    if ctx.device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    # This process's largest resident set so far (pinned offload buffers included): the host's side.
    row["host_max_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row, verdict


def _aborted(abort: GuardAbort, *, state: StepState, metrics, run: Prepared, optimizer, scheduler, ctx: RunContext,
             ending: Ending) -> None:
    """A guard stopped the run at this step: its row says so, and the state before the step
    (no optimizer step was taken) is saved as the previous step's checkpoint."""
    if metrics is not None:
        metrics(row={"step": state.step, "loss": state.loss, "grad_norm": state.grad_norm, "aborted": abort.message})
    last_good = state.step - 1
    saved = checkpoint.checkpoint_dirs(ctx.run_dir)
    if ctx.recipe.train.checkpoint_every != -1 and last_good >= 1 and not (saved and saved[-1].name ==
                                                                            f"step-{last_good}"):
        path = checkpoint.save(run_dir=ctx.run_dir, step=last_good, model=run.model, optimizer=optimizer,
                               scheduler=scheduler, rank=ctx.rank, keep=ctx.recipe.train.keep_checkpoints,
                               positions=ctx.positions)
        ctx.log.info("checkpoint.saved", step=last_good, path=str(path), reason="guard abort: the last good state")
        ending.checkpoint = path.name


#: eval.best_by -> the metrics row's key it compares.
_BEST_BY = {"loss": "eval_loss", "accuracy": "eval_accuracy"}


def _better(value: float | None, *, than: dict | None, metric: str = "eval_loss") -> bool:
    """A finite held-out loss below the best so far, or an accuracy above it (or the first);
    a best of the other metric (the recipe's eval.best_by changed on resume) is beaten."""
    if value is None or not math.isfinite(value):
        return False
    if than is None or metric not in than:
        return True
    return value > than[metric] if metric == "eval_accuracy" else value < than[metric]


def _checkpoint_due(every: int, *, step: int, last: int, verdict: Verdict, interrupted: bool = False) -> bool:
    """Every ``every`` steps, at the end (0: only at the end) and when interrupted; -1: never,
    not even when a guard asks (a run that writes no checkpoint said so in its recipe)."""
    if every == -1:
        return False
    return (every > 0 and step % every == 0) or step == last or verdict.action == "checkpoint" or interrupted


def _verdict(pm: WeftPluginManager, event: str, state: StepState, plan: Plan, ctx: RunContext) -> Verdict:
    verdicts = [v for v in pm.guard(event=event, state=state, plan=plan, ctx=ctx) if v is not None]
    return Verdict.strongest(verdicts)
