"""Several datasets as one: how many samples each source gives, which ones, and the mixed view.

Plain Python, deterministic in the seed: every rank draws the same mixture, so no index
is exchanged. The counts are exact quotas (largest remainders), not a draw per sample, so
weights 0.5/0.3/0.2 give those shares to the sample over any total; which samples of a
source fill its quota is drawn from the seed, every sample once before any twice.
"""

from __future__ import annotations

import random
from typing import Sequence


def quotas(sizes: Sequence[int], *, weights: Sequence[float | None], samples: Sequence[int | None],
           total: int = 0) -> list[int]:
    """Each source's samples in the mixture.

    A source with ``samples`` gives that many (repeating itself when it has fewer); one with a
    ``weight`` a share of the weighted total: ``total`` when given, else the largest total in
    which no weighted source repeats a sample (the first one exhausted ends it); a source with
    neither gives all it has, once. Weights and counts are not mixed in one mixture."""
    weighted = [i for i, w in enumerate(weights) if w is not None]
    if weighted and any(samples[i] is not None for i in range(len(sizes))):
        raise ValueError("give every source a weight, or give them sample counts; not both in one mixture")
    counts = [samples[i] if samples[i] is not None else sizes[i] for i in range(len(sizes))]
    if not weighted:
        return counts
    shares = [weights[i] / sum(weights[i] for i in weighted) for i in weighted]
    if not total:
        total = int(min(sizes[i] / share for i, share in zip(weighted, shares) if share > 0) + 1e-9)
    exact = [share * total for share in shares]
    given = [int(x) for x in exact]
    # The samples rounding left: to the largest remainders (earlier sources on a tie).
    for k in sorted(range(len(exact)), key=lambda k: (given[k] - exact[k], k))[:total - sum(given)]:
        given[k] += 1
    for i, count in zip(weighted, given):
        counts[i] = count
    return counts


def chosen(size: int, count: int, *, seed: int, source: int) -> list[int]:
    """``count`` indices into a source of ``size`` samples: whole passes over a shuffle of it,
    then the head of one more shuffle (a sample repeats only once every sample has been taken)."""
    if count and not size:
        raise ValueError("a source with no usable sample cannot give any")
    picked: list[int] = []
    passes = 0
    while len(picked) < count:
        order = list(range(size))
        random.Random(f"{seed}:mix:{source}:{passes}").shuffle(order)
        picked += order[:count - len(picked)]
        passes += 1
    return picked


class Mixture(Sequence):
    """The sources' chosen samples end to end, read by index; ``token_counts`` from theirs
    (a store's sidecars: nothing read) and ``ids``, each sample's (source, index in it)."""

    def __init__(self, parts: Sequence[Sequence], picks: Sequence[Sequence[int]]) -> None:
        from weft.strategies.data.shards import token_counts

        self.parts = parts
        self.ids = [(source, index) for source, chosen_ in enumerate(picks) for index in chosen_]
        counts = [token_counts(part) for part in parts]
        self.token_counts = [counts[source][index] for source, index in self.ids]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: int):
        source, index = self.ids[k]
        return self.parts[source][index]


def sample_id(samples: Sequence, k: int):
    """The k-th sample's id in the data as read: its index among its file's good samples (in
    file order), or [source, that index] in a mixture; views (checks, cuts) see through."""
    from weft.strategies.data.shards import SampleView

    while isinstance(samples, SampleView):
        samples, k = samples.base, samples.indices[k]
    if isinstance(samples, Mixture):
        source, index = samples.ids[k]
        return [source, sample_id(samples.parts[source], index)]
    return k
