"""The held-out loss: every micro-batch of a one-pass batching once, forward only, under the
run's plan (its sharding, sequence parallelism, kernels, autocast and loss). One code for
`weft eval`'s figure and a run's ``eval_loss`` (``[eval]``): the loss is the mean over every
label token of the samples, as one unsharded forward over each sample gives it."""

from __future__ import annotations

import itertools
import json
import time
from typing import TYPE_CHECKING, Any, Iterable

import attrs
import torch
import torch.distributed as dist

from weft.core.errors import WeftError
from weft.core.train.loss import IGNORE, targets
from weft.core.train.oom import eval_out_of_memory
from weft.core.train.step import run_micro_batches
from weft.core.whole_files import write_lines_whole

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe import Recipe
    from weft.core.train.prepare import Prepared


def held_out_recipe(recipe: Any, *, data: Any) -> Any:
    """The recipe the held-out batching reads: ``data`` for ``[data]``, and ``eval.micro_batch_tokens``
    (when set) for the micro-batches, the longest sample still the training's ``seq_len``."""
    held_out = attrs.evolve(recipe, data=data)
    if recipe.eval.micro_batch_tokens:
        held_out = attrs.evolve(held_out, train=attrs.evolve(
            recipe.train, micro_batch_tokens=recipe.eval.micro_batch_tokens, max_seq_len=recipe.train.seq_len))
    return held_out


def forward_pass(*, run: Prepared, rounds: Iterable, autocast: Any, ctx: RunContext, max_batches: int = 0,
                 after_step: int | None = None) -> dict:
    """Sum of the loss over every label token, their count, and the whole-sequence tokens and
    micro-batches with labels (every rank's, each SP group counted once), with the seconds it took.
    Out of memory, it is weft's message for evaluation (``after_step``: the run's step it follows)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    seen = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # this rank's tokens, micro-batches
    stats: dict[str, torch.Tensor] = {}  # the objective's values beside the loss, summed over its units
    labels = 0.0  # global label tokens: run_micro_batches reduces them over every rank
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        for index, micro_batches in enumerate(rounds):
            if max_batches and index >= max_batches:
                break  # every rank has the same number of rounds, so all stop together
            try:
                part, totals = run_micro_batches(model=run.model, micro_batches=micro_batches, split=run.split,
                                                 keep_vision=run.keep_vision, autocast=autocast, ctx=ctx,
                                                 fused=run.fused, objective=run.objective, backward=False)
            except torch.OutOfMemoryError as error:
                local = tuple(int(mb["input_ids"].numel()) for mb in micro_batches if "input_ids" in mb)
                raise eval_out_of_memory(after_step=after_step, local_tokens=local, ctx=ctx) from error
            loss_sum += part.double()
            labels += float(totals[0])
            for name, value in (run.objective.step_stats() if run.objective is not None else {}).items():
                stats[name] = stats.get(name, 0.0) + value.detach().double()
            # Whole-sequence tokens of the micro-batches with labels (padding rounds have none);
            # every rank of an SP group sees the same micro-batch: divided by its size below.
            real = [mb for mb in micro_batches if bool((targets(mb) != IGNORE).any())]
            seen += torch.tensor([sum(mb["input_ids"].numel() for mb in real), len(real)], dtype=torch.float64,
                                 device=ctx.device)
    dist.all_reduce(loss_sum)
    dist.all_reduce(seen)
    names = sorted(stats)  # every rank runs the same objective over the same rounds: the same names
    if names:
        sums = torch.stack([stats[name].to(ctx.device) for name in names])
        dist.all_reduce(sums)
        stats = dict(zip(names, (sums / max(labels, 1.0)).tolist()))
    sp = run.plan.mesh.sp
    return {"loss_sum": float(loss_sum), "labels": labels, "tokens": float(seen[0]) / sp,
            "micro_batches": float(seen[1]) / sp, "seconds": time.perf_counter() - start,
            "stats": stats}


#: Rounds past which the held-out pass is taken for a batching strategy that never ends.
MAX_ROUNDS = 100_000


class HeldOut:
    """A run's evaluation every ``eval.every`` steps: the batching's one pass over ``[eval.data]``
    (``[data]`` when the recipe names none) made into rounds once, before the first step (a
    data mistake ends the run before it trains), then at each call the mean loss over them on
    the current weights, in eval mode, without touching the run's random streams (its steps
    draw the same with an evaluation as without)."""

    def __init__(self, *, recipe: Recipe, run: Prepared, pm: WeftPluginManager, ctx: RunContext,
                 autocast: Any) -> None:
        self.every, self.last = recipe.eval.every, recipe.train.max_steps
        self.run, self.ctx, self.autocast = run, ctx, autocast
        held_out = held_out_recipe(recipe, data=recipe.eval.data or recipe.data)
        # Its own context: one pass from the first sample, its own counts of skipped samples.
        eval_ctx = attrs.evolve(ctx, one_pass=True, counters={}, state=attrs.evolve(ctx.state, start_step=0))
        decision = run.plan.decision("batching")
        with torch.random.fork_rng(devices=self._devices()):
            rounds = pm.batching(decision=decision, recipe=held_out, plan=run.plan, mesh=run.mesh, model=run.model,
                                 ctx=eval_ctx)
            self.rounds = list(itertools.islice(rounds, MAX_ROUNDS + 1))
        if len(self.rounds) > MAX_ROUNDS:  # a strategy that ignores ctx.one_pass would never end
            raise WeftError(f"batching strategy {decision.strategy!r} gave more than {MAX_ROUNDS:,} rounds for the "
                            "held-out pass: it must end after one pass when ctx.one_pass is set (docs/hooks.md, "
                            "weft_batching)", where=f"{recipe.source} (eval)")
        labels = torch.tensor(float(sum(int((targets(mb) != IGNORE).sum()) for r in self.rounds for mb in r)),
                              dtype=torch.float64, device=ctx.device)
        dist.all_reduce(labels)
        if not labels:
            where = "eval.data" if recipe.eval.data is not None else "data"
            raise WeftError(f"the held-out samples hold no label token to evaluate ({len(self.rounds)} rounds, "
                            f"{eval_ctx.counters.get('skipped_samples', 0)} samples skipped): give [eval.data] "
                            "samples with labels", where=f"{recipe.source} ({where})")
        ctx.log.info("eval.ready", rounds=len(self.rounds), label_tokens=int(labels), every=self.every,
                     in_sample=recipe.eval.data is None, skipped=dict(eval_ctx.counters))
        self.task = TaskQuestions(recipe=recipe, ctx=ctx) if recipe.eval.task is not None else None

    def _devices(self) -> list:
        return [self.ctx.device] if self.ctx.device.type == "cuda" else []

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last

    def __call__(self, *, step: int) -> dict[str, float]:
        model, training = self.run.model, self.run.model.training
        with torch.random.fork_rng(devices=self._devices()):
            model.eval()
            try:
                done = forward_pass(run=self.run, rounds=self.rounds, autocast=self.autocast, ctx=self.ctx,
                                    after_step=step)
                # The loss's divisor by its name: eval_tokens (label tokens), eval_pairs (a preference loss).
                unit = self.run.objective.unit if self.run.objective is not None else "tokens"
                row = {"eval_loss": done["loss_sum"] / done["labels"], f"eval_{unit}": int(done["labels"]),
                       "eval_s": round(done["seconds"], 4), **{f"eval_{k}": v for k, v in done["stats"].items()}}
                if self.task is not None:
                    row.update(self.task(run=self.run, autocast=self.autocast, step=step))
            finally:
                model.train(training)
        return row


class TaskQuestions:
    """``eval.task`` in a run: its questions encoded once, before the first step (a malformed
    line ends the run before it trains), then scored at each evaluation by log-likelihood under
    the run's plan, as `weft eval --task` scores them on that step's checkpoint; each question's
    row in ``eval/task-step-N.jsonl`` (rank 0)."""

    def __init__(self, *, recipe: Recipe, ctx: RunContext) -> None:
        from weft.core.train.task_file import load_task
        from weft.core.train.task_scores import encode_task

        path = recipe.task_file()
        self.items = load_task(path)
        generated = [item for item in self.items if item.choices is None]
        if generated:
            raise WeftError(f"{len(generated)} of eval.task's questions have no choices (line {generated[0].line} "
                            "first): in a run a task is scored by log-likelihood; give them choices, or score "
                            "generated answers with `weft eval --task` on the checkpoints",
                            where=f"{recipe.source} (eval.task)")
        self.encoded = encode_task(self.items, path=path, recipe=recipe, ctx=ctx)
        self.ctx = ctx

    def __call__(self, *, run: Prepared, autocast: Any, step: int) -> dict[str, float]:
        from weft.core.train.task_scores import result_row, score_choices, summarize

        try:
            scores = score_choices(self.encoded, run=run, ctx=self.ctx, autocast=autocast)
        except torch.OutOfMemoryError as error:
            raise eval_out_of_memory(after_step=step, local_tokens=(), ctx=self.ctx) from error
        rows = [result_row(item, scores[i], None) for i, item in enumerate(self.items)]
        found = summarize(rows)
        if self.ctx.rank == 0 and self.ctx.run_dir is not None:
            folder = self.ctx.run_dir / "eval"
            folder.mkdir(exist_ok=True)
            write_lines_whole(folder / f"task-step-{step}.jsonl", [json.dumps(r) for r in rows])
        return {"eval_accuracy": found["accuracy"], "eval_accuracy_norm": found["accuracy_norm"],
                "eval_accuracy_low": found["interval_95"][0], "eval_accuracy_high": found["interval_95"][1]}
