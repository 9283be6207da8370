"""`weft eval --task FILE.jsonl`: accuracy on questions with a right answer, under the recipe's plan.

A task file's lines (strategies/data/tasks.py) are conversations in any data format with an
``answer`` (and ``choices``). Choices are scored by log-likelihood under the plan itself —
sharding, sequence parallelism, kernels, precision — one sequence per micro-batch, the
data-parallel groups taking turns: each sequence's summed label log-likelihood is the sum of
its SP ranks' parts. Answers without choices are generated greedily, batched through the
static cache (core/commands/generate_batch.py), on one process. Reported: accuracy with its 95%
Wilson interval (for choices also length-normalised), and one JSON line per question
(``--results``): its id, the prediction, right or wrong, the choices' scores.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any

import torch
import torch.distributed as dist

from weft.core.errors import WeftError
from weft.core.recipe import Recipe


def load_task(path: pathlib.Path) -> list:
    """The task's questions, each malformed line a message naming ``FILE:LINE`` (exit 2)."""
    from weft.core.commands.task_file import TaskLineError, read_task

    if not path.is_file():
        raise WeftError(f"no such file: {path}; --task takes a JSONL file of questions (docs/inference.md)",
                        where="--task")
    try:
        items = list(read_task(path))
    except TaskLineError as error:
        raise WeftError(error.reason, where=f"{path}:{error.line}") from None
    except UnicodeDecodeError as error:
        raise WeftError(f"not UTF-8 text ({error.reason})", where=str(path)) from None
    if not items:
        raise WeftError(f"{path} holds no question", where="--task")
    return items


def score_task(recipe: Recipe, *, rank: int, world_size: int, local_rank: int, device_type: str,
               run_dir: pathlib.Path | None, step: int | None, task: str, results: str,
               max_new_tokens: int = 32, adapter_dir: str | None = None) -> dict:
    """One rank's part; rank 0 writes ``results`` and returns the summary."""
    from weft.core.run.rank_job import prepare_inference
    from weft.core.train.step import autocast_for

    path = pathlib.Path(task)
    items = load_task(path)
    pm, ctx, run, checkpoint = prepare_inference(recipe, rank=rank, world_size=world_size, local_rank=local_rank,
                                                 device_type=device_type, run_dir=run_dir, step=step, one_pass=True,
                                                 adapter_dir=adapter_dir)
    encoded = []
    for item in items:
        try:
            encoded.append(ctx.adapter.task_inputs(recipe, record=item.record, base=path.parent,
                                                   choices=item.choices))
        except (OSError, ValueError) as error:
            raise WeftError(f"cannot read this question: {error}", where=f"{path}:{item.line}") from None
    autocast = autocast_for(recipe.train.precision, device_type)
    owners = [i for i, (_, batches) in enumerate(encoded) for _ in batches]
    values = sequence_log_likelihoods([b for _, batches in encoded for b in batches], run=run, ctx=ctx,
                                      autocast=autocast)
    scores: dict[int, list[float]] = {}
    for owner, value in zip(owners, values):
        scores.setdefault(owner, []).append(value)
    generated = _generated(items, [prompt for prompt, _ in encoded], run=run, ctx=ctx, pm=pm, recipe=recipe,
                           autocast=autocast, max_new_tokens=max_new_tokens)
    rows = [_row(item, scores.get(i), generated.get(i)) for i, item in enumerate(items)]
    if rank == 0:
        with open(results, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    return {**_summary(rows), "task": str(path), "results": results, "checkpoint": checkpoint,
            "world_size": world_size, "precision": recipe.train.precision}


def sequence_log_likelihoods(batches: list[dict], *, run, ctx, autocast) -> list[float]:
    """Each micro-batch's (one sequence each) summed log-likelihood of its label tokens under the
    plan: data-parallel group ``d`` takes batches d, d + dp, ...; every rank runs the same number
    of rounds (the last padded with a label-less copy); each SP rank adds its part."""
    from weft.core.train.loss import IGNORE
    from weft.core.train.step import run_micro_batches

    dp, me = run.plan.mesh.dp, run.mesh.dp_rank()
    total = torch.zeros(len(batches), dtype=torch.float64, device=ctx.device)
    with torch.no_grad():
        for r in range(-(-len(batches) // dp)):
            index = r * dp + me
            batch = batches[index] if index < len(batches) else \
                {**batches[0], "labels": torch.full_like(batches[0]["labels"], IGNORE)}
            part, _ = run_micro_batches(model=run.model, micro_batches=[batch], split=run.split,
                                        keep_vision=run.keep_vision, autocast=autocast, ctx=ctx, fused=run.fused,
                                        backward=False)
            if index < len(batches):
                total[index] += part.double()  # the loss part: -log-likelihood of this rank's label tokens
    dist.all_reduce(total)
    return (-total).tolist()


def _generated(items, prompts, *, run, ctx, pm, recipe: Recipe, autocast, max_new_tokens: int) -> dict[int, str]:
    """Each generation question's greedy reply, its stop token dropped."""
    from weft.core.commands.decode import stop_tokens
    from weft.core.commands.generate_batch import generate_batch

    wanted = [i for i, item in enumerate(items) if item.choices is None]
    if not wanted:
        return {}
    if ctx.world_size > 1:
        raise WeftError(f"{len(wanted)} question(s) are answered by generation, which runs on one process; run "
                        "this task with --nproc 1, or give its lines 'choices' (scored by log-likelihood under any "
                        "plan)", where="--task")
    if run.fused is not None:  # no loss while decoding: its hook would hold the prefill's hidden states
        run.fused.handle.remove()
    out = generate_batch(run.model, run=run, ctx=ctx, pm=pm, recipe=recipe, inputs=[prompts[i] for i in wanted],
                         max_new_tokens=max_new_tokens, autocast=autocast, cuda_graph=ctx.device.type == "cuda",
                         profiled=lambda: contextlib.nullcontext({}))  # its steps' count lands in a dict
    stops = set(stop_tokens(run.model))
    texts = {}
    for i, answer in zip(wanted, out["answers"]):
        ids = list(answer["tokens"])
        while ids and ids[-1] in stops:
            ids.pop()
        texts[i] = ctx.adapter.decode_tokens(recipe, ids)
    return texts


def _row(item, scores: list[float] | None, text: str | None) -> dict:
    from weft.core.commands.task_file import normalize

    if scores is not None:
        best = max(range(len(scores)), key=lambda j: scores[j])
        per_byte = [s / max(1, len(c.encode("utf-8"))) for s, c in zip(scores, item.choices)]
        best_norm = max(range(len(per_byte)), key=lambda j: per_byte[j])
        return {"id": item.id, "line": item.line, "scoring": "choices", "answer": item.answer,
                "prediction": item.choices[best], "right": best == item.right,
                "prediction_norm": item.choices[best_norm], "right_norm": best_norm == item.right,
                "log_likelihoods": [round(s, 6) for s in scores]}
    return {"id": item.id, "line": item.line, "scoring": "generation", "answer": item.answer, "prediction": text,
            "right": normalize(text or "") == normalize(item.answer)}


def _summary(rows: list[dict]) -> dict:
    from weft.core.commands.task_file import wilson

    right = sum(bool(r["right"]) for r in rows)
    low, high = wilson(right, len(rows))
    summary = {"questions": len(rows), "right": right, "accuracy": right / len(rows),
               "interval_95": [round(low, 4), round(high, 4)],
               "by_scoring": {k: sum(r["scoring"] == k for r in rows) for k in ("choices", "generation")}}
    chosen = [r for r in rows if r["scoring"] == "choices"]
    if chosen:
        right_norm = sum(bool(r["right_norm"]) for r in chosen)
        summary["accuracy_norm"] = right_norm / len(chosen)  # over the choice questions
        summary["interval_95_norm"] = [round(x, 4) for x in wilson(right_norm, len(chosen))]
    return summary


def render(result: dict[str, Any]) -> str:
    """One paragraph for the terminal."""
    low, high = result["interval_95"]
    text = (f"accuracy {result['accuracy']:.4f} ({result['right']} of {result['questions']}; 95% interval "
            f"{low:.4f}-{high:.4f})")
    if "accuracy_norm" in result:
        lo, hi = result["interval_95_norm"]
        text += f", length-normalised {result['accuracy_norm']:.4f} ({lo:.4f}-{hi:.4f})"
    return (text + f" on {result['task']}, {result['world_size']} rank(s), {result['precision']}"
            + (f", weights from {result['checkpoint']}" if result["checkpoint"] else "")
            + f"; per question: {result['results']}")
