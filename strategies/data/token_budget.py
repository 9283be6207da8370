"""Token-budget batching: micro-batches filled up to a padded-token budget, steps of equal shape on every rank.

Plain Python, deterministic in (seed, epoch): every rank computes the same global
schedule and takes its own column, so no lengths need exchanging.
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
    batches: list[list[int]], lengths: list[int], *, dp_size: int, step_tokens: int, packed: bool = False
) -> list[list[list[list[int]]]]:

    """Arrange micro-batches into optimizer steps: step -> round -> dp rank -> sample indices.

    A round gives each data-parallel rank one micro-batch; a step takes rounds
    until ``step_tokens`` tokens (over all ranks; padded, or summed when ``packed``)
    are reached, at least one.
    Leftover micro-batches that cannot fill a round or a step are dropped: every
    rank must run the same number of micro-batches, since each issues collectives.
    """
    rounds = [batches[i : i + dp_size] for i in range(0, len(batches) - dp_size + 1, dp_size)]
    steps: list[list[list[list[int]]]] = []
    current: list[list[list[int]]] = []
    tokens = 0
    for round_ in rounds:
        current.append(round_)
        tokens += sum(sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb) for mb in round_)
        if tokens >= step_tokens:
            steps.append(current)
            current, tokens = [], 0
    return steps
