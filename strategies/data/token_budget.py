"""Token-budget batching: micro-batches filled up to a padded-token budget, steps of equal shape on every rank.

Plain Python, deterministic in (seed, epoch): every rank computes the same global
schedule and takes its own column, so no lengths need exchanging. A slot of None in a
schedule is a filler: that rank runs a copy of a micro-batch with no label kept.
"""

from __future__ import annotations

import random


def pack_micro_batches(
    lengths: list[int], *, budget: int, seed: int, epoch: int, bucket_size: int = 256
) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size (count x longest) fits ``budget``.

    Samples are shuffled, then sorted by length inside buckets of ``bucket_size``
    so a micro-batch holds similar lengths (little padding) while the order
    across buckets stays random. Samples longer than the budget are left out;
    the caller counts them.
    """
    rng = random.Random(f"{seed}:{epoch}")
    order = [i for i in range(len(lengths)) if lengths[i] <= budget]
    rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), bucket_size):
        chunk = sorted(order[start : start + bucket_size], key=lambda i: lengths[i])
        current: list[int] = []
        longest = 0
        for index in chunk:
            grown = max(longest, lengths[index])
            if current and grown * (len(current) + 1) > budget:
                batches.append(current)
                current, grown = [], lengths[index]
            current.append(index)
            longest = grown
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


def schedule_steps(
    batches: list[list[int]], lengths: list[int], *, dp_size: int, step_tokens: int, packed: bool = False,
    whole: bool = False,
) -> list[list[list[list[int] | None]]]:
    """Arrange micro-batches into optimizer steps: step -> round -> dp rank -> sample indices.

    A round gives each data-parallel rank one micro-batch; a step takes rounds
    until ``step_tokens`` tokens (over all ranks; padded, or summed when ``packed``)
    are reached, at least one.
    Leftover micro-batches that cannot fill a round or a step are dropped: every
    rank must run the same number of micro-batches, since each issues collectives.
    With ``whole`` (an epoch: every sample once) they are kept: the last round's
    missing slots are None (fillers) and the last step may hold fewer tokens.
    """
    if whole:
        padded = batches + [None] * (-len(batches) % dp_size)
        rounds = [padded[i : i + dp_size] for i in range(0, len(padded), dp_size)]
    else:
        rounds = [batches[i : i + dp_size] for i in range(0, len(batches) - dp_size + 1, dp_size)]
    return _cut_steps(rounds, lambda round_: sum(_tokens(mb, lengths, packed) for mb in round_ if mb is not None),
                      step_tokens, keep_tail=whole)


def schedule_global_steps(
    batches: list[list[int]], lengths: list[int], *, dp_size: int, step_tokens: int, packed: bool = False,
    whole: bool = False,
) -> list[list[list[list[int] | None]]]:
    """The same optimizer steps at any data-parallel size: step -> round -> dp rank -> sample indices.

    A step takes micro-batches until ``step_tokens`` tokens, as one rank would, and deals
    them round-robin over the ranks. Since the loss divides by the step's label tokens over
    every rank, the step's loss and gradient do not depend on how its micro-batches are
    dealt, only on which they are. A rank left without a micro-batch in the last round gets
    None: a filler that keeps its collectives in step with the others and adds nothing.
    A last step short of ``step_tokens`` is dropped, or with ``whole`` (an epoch) kept.
    """
    steps = []
    for micro in _cut_steps(batches, lambda mb: _tokens(mb, lengths, packed), step_tokens, keep_tail=whole):
        padded = micro + [None] * (-len(micro) % dp_size)
        steps.append([padded[i : i + dp_size] for i in range(0, len(padded), dp_size)])
    return steps


def _tokens(micro_batch: list[int], lengths: list[int], packed: bool) -> int:
    """Padded tokens (count x longest), or the sum when packed into one row."""
    return sum(lengths[i] for i in micro_batch) if packed else len(micro_batch) * max(lengths[i] for i in micro_batch)


def _cut_steps(items: list, size, step_tokens: int, *, keep_tail: bool = False) -> list[list]:
    """Consecutive items into steps of at least ``step_tokens`` (by ``size``); a short tail is
    dropped, or kept as a last step with ``keep_tail``."""
    steps, current, tokens = [], [], 0
    for item in items:
        current.append(item)
        tokens += size(item)
        if tokens >= step_tokens:
            steps.append(current)
            current, tokens = [], 0
    if keep_tail and current:
        steps.append(current)
    return steps
