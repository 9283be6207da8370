"""A generated answer scored in one teacher-forced pass under the plan (`weft eval --task --forced`,
and every generation question on 2+ ranks).

The question and its reference answer are one sequence; the model's greedy choice at each of
the answer's positions is the argmax of its logits there. Greedy decoding emits exactly those
tokens for as long as they equal the answer (each step's context is then the same), and at the
first one that differs emits that one too: so the answer is right by greedy decoding if and
only if every argmax is the answer's token, and the prediction reported — the argmaxes up to and
including the first wrong one — is the start of the greedy reply, token for token. One forward
per question, under any sharding and sequence parallelism (each rank's argmaxes at its own
positions, summed into the whole sequence over the sequence-parallel group), with the logits of
the answer's positions only (``logits_to_keep``): a 128K-token question never holds (S, V)
logits. Right is token-exact (stricter than generation's normalised match).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.train.prepare import Prepared


def forced_replies(batches: list[dict], *, run: Prepared, ctx: RunContext, autocast: Any) -> list[tuple[list, list]]:
    """Each micro-batch's (one sequence, labels on the answer's tokens) (argmax tokens, answer
    tokens) over its label positions in order. Data-parallel group ``d`` takes batches d, d + dp,
    ...; every rank runs the same number of forwards (the last round a copy when short); every
    rank returns every batch's."""
    from weft.core.train.loss import IGNORE
    from weft.core.train.step import shard_micro_batch, targets

    dp, me = run.plan.mesh.dp, run.mesh.dp_rank()
    mine: dict[int, tuple[list, list]] = {}
    with torch.no_grad():
        for r in range(-(-len(batches) // dp)):
            index = r * dp + me
            batch = batches[min(index, len(batches) - 1)]
            local = shard_micro_batch(batch, run.split)
            target = targets(local)[0]  # (S_local,): the next token at each of this rank's positions
            length = local["input_ids"].shape[1]  # the whole (padded) sequence
            positions = (torch.arange(length) if run.split is None
                         else run.split.shard(torch.arange(length)[None], dim=1)[0])  # (S_local,) global
            keep = (target != IGNORE).nonzero()[:, 0]  # (K,) local rows of answer positions
            inputs = {k: v.to(ctx.device) for k, v in local.items() if k not in ("labels", "shift_labels")}
            with autocast:
                logits = run.model(**inputs, use_cache=False,
                                   logits_to_keep=(keep if len(keep) else torch.tensor([0])).to(ctx.device)).logits
            chosen = torch.zeros(length, dtype=torch.long, device=ctx.device)  # (S,): argmax + 1 where ours
            wanted = torch.zeros(length, dtype=torch.long, device=ctx.device)
            if len(keep):
                rows = positions[keep].to(ctx.device)
                chosen[rows] = logits[0, -len(keep):].argmax(-1) + 1
                wanted[rows] = target[keep].to(ctx.device) + 1
            if run.split is not None:  # each position is one rank's: the sum is the whole sequence
                both = torch.stack([chosen, wanted])
                dist.all_reduce(both, group=run.mesh.sp.get_group())
                chosen, wanted = both[0], both[1]
            if index < len(batches):
                held = wanted > 0
                mine[index] = ((chosen[held] - 1).tolist(), (wanted[held] - 1).tolist())
    gathered: list[dict] = [None] * ctx.world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    found = {i: pair for part in gathered for i, pair in part.items()}
    return [found[i] for i in range(len(batches))]


def forced_row_fields(chosen: list[int], wanted: list[int], *, decode, closing: bool = True) -> dict:
    """The results row's prediction (the greedy reply's start: through its first wrong token) and
    whether it is right (every token the answer's). ``closing``: the last token is the reply's
    closing one (a conversation's; a plain-text continuation has none)."""
    wrong = next((i for i, (a, b) in enumerate(zip(chosen, wanted)) if a != b), None)
    shown = chosen if wrong is None else chosen[: wrong + 1]
    # Right: the reply as generation reports it, its closing token dropped.
    text = decode(shown[:-1] if wrong is None and closing else shown)
    return {"prediction": text, "right": wrong is None, "prediction_tokens": shown}
