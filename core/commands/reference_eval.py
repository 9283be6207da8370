"""`weft eval RECIPE --reference OUT.jsonl`: the reference model's log-probabilities of every
preference pair of the recipe's data, written beside the records for `reference = "batch"`.

DPO compares the policy with a reference model, usually the model the training starts from.
With LoRA that is the base with its adapters off (`reference = "adapters"`, no pass needed);
for full fine-tuning a second copy would double the weights' memory, so the reference's summed
log-probabilities of each response are computed once here, in one forward pass over the pairs
under the recipe's plan (its sharding, sequence parallelism, kernels and precision: each
conversation one micro-batch, the data-parallel groups taking turns, each sequence-parallel
rank adding its part), from the recipe's weights or a run's checkpoint (``--run-dir``). OUT
holds each pair's record as it was with TRL's ``ref_chosen_logps`` and ``ref_rejected_logps``
set; a record that is not a pair, or cannot be read, is skipped and counted (named in the
result), as training would skip it. OUT is written whole or not at all.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import time
from typing import Any

from weft.core.errors import WeftError
from weft.core.recipe import Recipe
from weft.core.whole_files import written_whole

#: Pairs encoded and scored at a time (both conversations each): the micro-batches held at once.
CHUNK_PAIRS = 64


def reference_options(args: Any) -> dict:
    """`weft eval --reference OUT`'s options, checked before any rank starts."""
    for flag, given in (("--task", args.task is not None), ("--max-batches", args.max_batches is not None),
                        ("--results", args.results is not None), ("--forced", args.forced)):
        if given:
            raise WeftError(f"{flag} does not go with --reference (every pair of the recipe's data, or of --data)",
                            where=flag)
    out = args.reference.resolve()
    if not out.parent.is_dir():
        raise WeftError(f"no folder {out.parent} to write the pairs into", where="--reference")
    return {"reference": str(out)}


def reference_needs(recipe: Recipe) -> dict[str, str]:
    why = "`weft eval --reference` (the pairs encoded as training encodes them)"
    return {"tokenizer": why, "image processor": why}


def write_reference(recipe: Recipe, *, rank: int, world_size: int, local_rank: int, device_type: str,
                    run_dir: pathlib.Path | None, step: int | None, reference: str,
                    adapter_dir: str | None = None) -> dict:
    """One rank's part; rank 0 writes ``reference`` and returns the summary."""
    from weft.core.infer.prepare_inference import prepare_inference
    from weft.core.train.step import autocast_for
    from weft.core.train.task_scores import sequence_log_likelihoods

    pm, ctx, run, checkpoint = prepare_inference(recipe, rank=rank, world_size=world_size, local_rank=local_rank,
                                                 device_type=device_type, run_dir=run_dir, step=step, one_pass=True,
                                                 adapter_dir=adapter_dir)
    autocast = autocast_for(recipe.train.precision, device_type)
    out = pathlib.Path(reference)
    pairs, bad, tokens, start = 0, [], 0, time.perf_counter()
    records = ctx.family.pair_inputs(recipe)
    # Whole or not at all: a failure, or no pair at all, leaves no file (and no old one replaced).
    with (written_whole(out) if rank == 0 else open(os.devnull, "w")) as sink:
        while chunk := list(itertools.islice(records, CHUNK_PAIRS)):
            good = [(where, line, batches) for where, line, batches in chunk if not isinstance(batches, str)]
            bad += [f"{where}: {batches}" for where, _, batches in chunk if isinstance(batches, str)]
            if not good:
                continue
            # Every rank reads the same records in the same order: the same chunks, the same calls.
            values = sequence_log_likelihoods([b for _, _, both in good for b in both], run=run, ctx=ctx,
                                              autocast=autocast)
            for n, (_, line, both) in enumerate(good):
                record = json.loads(line)
                record["ref_chosen_logps"], record["ref_rejected_logps"] = values[2 * n], values[2 * n + 1]
                sink.write(json.dumps(record) + "\n")
                tokens += sum(int(b["input_ids"].numel()) for b in both)
            pairs += len(good)
        if rank == 0 and not pairs:
            shown = "; ".join(bad[:3]) or "no records"
            raise WeftError(f"no preference pair to score in {recipe.data.path} ({len(bad)} bad records: {shown})",
                            where="--reference")
    if rank != 0:
        return {}
    seconds = time.perf_counter() - start
    return {"pairs": pairs, "reference": str(out), "skipped": len(bad), "bad": bad[:20], "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9), "checkpoint": checkpoint,
            "world_size": world_size, "precision": recipe.train.precision, "data": recipe.data.path}


def render_reference(result: dict[str, Any]) -> str:
    """One paragraph for the terminal."""
    skipped = f"; {result['skipped']} bad records skipped (first: {result['bad'][0]})" if result["skipped"] else ""
    return (f"the reference log-probabilities of {result['pairs']:,} pairs ({result['tokens']:,} tokens, "
            f"{result['tokens_per_s']:,.0f} tokens/s on {result['world_size']} rank(s), {result['precision']}) "
            f"written to {result['reference']}{skipped}"
            + (f"; weights from {result['checkpoint']}" if result["checkpoint"] else "")
            + "; train on it with the dpo objective's reference = \"batch\"")
