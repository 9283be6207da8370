"""`weft eval --task`'s and a run's ``eval.task``'s scores: each choice's summed log-likelihood under
the plan (one sequence per micro-batch, the data-parallel groups taking turns, each sequence's
score the sum of its sequence-parallel ranks' parts), each question's row, the accuracy."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weft.core.errors import WeftError
from weft.core.train.task_file import normalize, wilson

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.recipe import Recipe
    from weft.core.train.prepare import Prepared


def encode_task(items: list, *, path: pathlib.Path, recipe: Recipe, ctx: RunContext,
                forced: bool = False) -> list[tuple[dict, list[dict]]]:
    """Each question's (prompt inputs, one micro-batch per choice), through the model family;
    with ``forced``, a generation question's one micro-batch is the question with its answer as
    the reply, labelled on the answer and its closing token (core/train/task_forced.py). A
    question that cannot be read is a message naming its line."""
    encoded = []
    for item in items:
        scored = item.choices if item.choices is not None or not forced else (item.answer,)
        try:
            encoded.append(ctx.family.task_inputs(recipe, record=item.record, base=path.parent, choices=scored,
                                                   reply_end=item.choices is None))
        except (OSError, ValueError) as error:
            raise WeftError(f"cannot read this question: {error}", where=f"{path}:{item.line}") from None
    return encoded


def score_choices(encoded: list[tuple[dict, list[dict]]], *, run: Prepared, ctx: RunContext,
                  autocast: Any) -> dict[int, list]:
    """Each choice question's summed log-likelihood per choice, by question index."""
    owners = [i for i, (_, batches) in enumerate(encoded) for _ in batches]
    values = sequence_log_likelihoods([b for _, batches in encoded for b in batches], run=run, ctx=ctx,
                                      autocast=autocast)
    scores: dict[int, list[float]] = {}
    for owner, value in zip(owners, values):
        scores.setdefault(owner, []).append(value)
    return scores


def sequence_log_likelihoods(batches: list[dict], *, run: Prepared, ctx: RunContext, autocast: Any) -> list[float]:
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


def result_row(item, scores: list[float] | None, text: str | None, forced: dict | None = None) -> dict:
    """One question's results line: choices' scores, a generated reply (``text``) or a
    teacher-forced one (``forced``: core/train/task_forced.py's fields); its ``meta`` copied."""
    row = _row(item, scores, text, forced)
    if item.meta is not None:
        row["meta"] = item.meta
    return row


def _row(item, scores: list[float] | None, text: str | None, forced: dict | None) -> dict:
    if forced is not None:
        return {"id": item.id, "line": item.line, "scoring": "forced", "answer": item.answer, **forced}
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


def summarize(rows: list[dict]) -> dict:

    right = sum(bool(r["right"]) for r in rows)
    low, high = wilson(right, len(rows))
    summary = {"questions": len(rows), "right": right, "accuracy": right / len(rows),
               "interval_95": [round(low, 4), round(high, 4)],
               "by_scoring": {k: sum(r["scoring"] == k for r in rows) for k in ("choices", "generation")}}
    forced = sum(r["scoring"] == "forced" for r in rows)
    if forced:  # generation questions scored in one teacher-forced pass (core/train/task_forced.py)
        summary["by_scoring"]["forced"] = forced
    chosen = [r for r in rows if r["scoring"] == "choices"]
    if chosen:
        right_norm = sum(bool(r["right_norm"]) for r in chosen)
        summary["accuracy_norm"] = right_norm / len(chosen)  # over the choice questions
        summary["interval_95_norm"] = [round(x, 4) for x in wilson(right_norm, len(chosen))]
    return summary


