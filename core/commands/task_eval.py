"""`weft eval --task FILE.jsonl`: accuracy on questions with a right answer, under the recipe's plan.

A task file's lines (core/train/task_file.py) are conversations in any data format with an
``answer`` (and ``choices``). Choices are scored by log-likelihood under the plan itself —
sharding, sequence parallelism, kernels, precision — one sequence per micro-batch, the
data-parallel groups taking turns: each sequence's summed label log-likelihood is the sum of
its SP ranks' parts. Answers without choices are generated greedily, batched through the
static cache (core/infer/generate_batch.py), on one process; with ``--forced``, and always on
2+ ranks, in one teacher-forced pass each under the plan (core/train/task_forced.py: the same
right or wrong as greedy decoding, the prediction the greedy reply up to its first wrong token).
Reported: accuracy with its 95% Wilson interval (for choices also length-normalised), and one
JSON line per question (``--results``): its id, the prediction, right or wrong, the choices'
scores, the line's ``meta``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
from typing import TYPE_CHECKING, Any

from weft.core.errors import WeftError
from weft.core.recipe import Recipe
from weft.core.train.task_file import load_task
from weft.core.train.task_scores import encode_task, result_row, score_choices, summarize
from weft.core.whole_files import write_lines_whole

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.train.prepare import Prepared


def task_options(args: Any) -> dict:
    """`weft eval --task FILE`'s options for the ranks, the file checked first (a malformed line
    is exit 2 naming it, before any rank starts)."""
    if args.data is not None or args.max_batches is not None:
        flag = "--data" if args.data is not None else "--max-batches"
        raise WeftError(f"{flag} goes with the loss; --task scores every question of its own file", where=flag)
    load_task(args.task)
    results = (args.results or pathlib.Path(f"{args.task.stem}.results.jsonl")).resolve()
    if not results.parent.is_dir():
        raise WeftError(f"no folder {results.parent} to write the results into", where="--results")
    return {"task": str(args.task.resolve()), "results": str(results), "max_new_tokens": args.max_new_tokens,
            "forced": args.forced}


def task_needs(recipe: Recipe) -> dict[str, str]:
    """What the questions read from the processor folder (core/run/model_files.py)."""
    why = "`weft eval --task` (questions encoded through the tokenizer and the image processor)"
    return {"tokenizer": why, "image processor": why}


def score_task(recipe: Recipe, *, rank: int, world_size: int, local_rank: int, device_type: str,
               run_dir: pathlib.Path | None, step: int | None, task: str, results: str,
               max_new_tokens: int = 32, adapter_dir: str | None = None, forced: bool = False) -> dict:
    """One rank's part; rank 0 writes ``results`` and returns the summary. Generation questions
    are teacher-forced with ``forced`` and on 2+ ranks (greedy decoding runs on one process)."""
    from weft.core.infer.prepare_inference import prepare_inference
    from weft.core.train.step import autocast_for

    path = pathlib.Path(task)
    items = load_task(path)
    pm, ctx, run, checkpoint = prepare_inference(recipe, rank=rank, world_size=world_size, local_rank=local_rank,
                                                 device_type=device_type, run_dir=run_dir, step=step, one_pass=True,
                                                 adapter_dir=adapter_dir)
    forced = forced or world_size > 1
    encoded = encode_task(items, path=path, recipe=recipe, ctx=ctx, forced=forced)
    autocast = autocast_for(recipe.train.precision, device_type)
    choices = [(prompt, batches if item.choices is not None else []) for item, (prompt, batches) in zip(items, encoded)]
    scores = score_choices(choices, run=run, ctx=ctx, autocast=autocast)
    replies = _forced(items, encoded, run=run, ctx=ctx, recipe=recipe, autocast=autocast) if forced else {}
    generated = {} if forced else _generated(items, [prompt for prompt, _ in encoded], run=run, ctx=ctx, pm=pm,
                                             recipe=recipe, autocast=autocast, max_new_tokens=max_new_tokens)
    rows = [result_row(item, scores.get(i), generated.get(i), replies.get(i)) for i, item in enumerate(items)]
    if rank == 0:  # written whole and renamed: a script that skips a question file it finds never reads half of one
        write_lines_whole(results, [json.dumps(row) for row in rows])
    return {**summarize(rows), "task": str(path), "results": results, "checkpoint": checkpoint,
            "world_size": world_size, "precision": recipe.train.precision}


def _forced(items, encoded, *, run: Prepared, ctx: RunContext, recipe: Recipe, autocast) -> dict[int, dict]:
    """Each generation question's teacher-forced reply (its results row's fields), by index."""
    from weft.core.train.task_forced import forced_replies, forced_row_fields

    wanted = [i for i, item in enumerate(items) if item.choices is None]
    if not wanted:
        return {}
    pairs = forced_replies([encoded[i][1][0] for i in wanted], run=run, ctx=ctx, autocast=autocast)
    decode = functools.partial(ctx.family.decode_tokens, recipe)
    return {i: forced_row_fields(chosen, answer, decode=decode,
                                 closing="messages" in items[i].record or "conversations" in items[i].record)
            for i, (chosen, answer) in zip(wanted, pairs)}


def _generated(items, prompts, *, run: Prepared, ctx: RunContext, pm: WeftPluginManager, recipe: Recipe, autocast,
               max_new_tokens: int) -> dict[int, str]:
    """Each generation question's greedy reply, its stop token dropped."""
    from weft.core.infer.decode import stop_tokens
    from weft.core.infer.generate_batch import generate_batch

    wanted = [i for i, item in enumerate(items) if item.choices is None]
    if not wanted:
        return {}
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
        texts[i] = ctx.family.decode_tokens(recipe, ids)
    return texts


def render_task(result: dict[str, Any]) -> str:
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
