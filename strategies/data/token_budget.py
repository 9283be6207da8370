"""Token-budget batching: micro-batches filled up to a padded-token budget, steps of equal shape on every rank.

Deterministic in (seed, epoch): every rank computes the same global schedule and takes its
own column, so no lengths need exchanging. A slot of None in a schedule is a filler: that rank
runs a copy of a micro-batch with no label kept.

Lazy, so the first step does not wait for the whole epoch: the epoch's order is one
``torch.randperm`` of the sample indices (milliseconds for a million), then micro-batches
are made and shuffled a window of ``WINDOW`` buckets at a time as the steps are taken. The
schedules are generators over them; a million-sample epoch costs its first step one window.
"""

from __future__ import annotations

import array
import hashlib
from typing import Iterable, Iterator, Sequence

import torch

#: Buckets whose micro-batches are shuffled among themselves (64 x 256 = 16,384 samples): the
#: order across windows comes from the epoch's permutation of the samples.
WINDOW = 64


def epoch_generator(tag: str, *, seed: int, epoch: int) -> torch.Generator:
    """torch's CPU generator for one epoch's order: the same on every rank and platform."""
    digest = hashlib.sha256(f"{tag}:{seed}:{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def as_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """(n,) int32 lengths, whatever sequence they came in (an ``array('i')`` without a copy)."""
    if isinstance(lengths, torch.Tensor):
        return lengths.to(torch.int32)
    if isinstance(lengths, array.array) and lengths.typecode == "i":
        return torch.frombuffer(lengths, dtype=torch.int32) if len(lengths) else torch.zeros(0, dtype=torch.int32)
    return torch.tensor(list(lengths), dtype=torch.int32)


def clipped(counts: Sequence[int], *, limit: int, over: int) -> array.array:
    """Token counts as batching lengths: a count over ``limit`` becomes ``over`` (past the
    budget: the sample is left out), as an ``array('i')`` (4 bytes a sample)."""
    sizes = as_lengths(counts)
    out = array.array("i")
    out.frombytes(torch.where(sizes <= limit, sizes, over).numpy().tobytes())
    return out


def shuffled_windows(lengths: torch.Tensor, *, budget: int, generator: torch.Generator,
                     span: int) -> Iterator[torch.Tensor]:
    """The indices of samples that fit ``budget``, permuted, ``span`` at a time."""
    fits = lengths <= budget
    if bool(fits.all()):  # the usual case: the permutation is the order, no index list besides
        order = torch.randperm(len(lengths), generator=generator, dtype=torch.int32)
    else:
        kept = torch.nonzero(fits).flatten().to(torch.int32)
        order = kept[torch.randperm(len(kept), generator=generator)]
    for start in range(0, len(order), span):
        yield order[start:start + span]


def pack_micro_batches(
    lengths: Sequence[int], *, budget: int, seed: int, epoch: int, bucket_size: int = 256
) -> Iterator[list[int]]:
    """Group sample indices into micro-batches whose padded size (count x longest) fits ``budget``.

    Samples are shuffled, then sorted by length inside buckets of ``bucket_size``
    so a micro-batch holds similar lengths (little padding) while the order
    across buckets stays random; the micro-batches of a window of buckets are
    shuffled among themselves. Samples longer than the budget are left out;
    the caller counts them.
    """
    sizes = as_lengths(lengths)
    generator = epoch_generator("batches", seed=seed, epoch=epoch)
    for window in shuffled_windows(sizes, budget=budget, generator=generator, span=bucket_size * WINDOW):
        batches: list[list[int]] = []
        for start in range(0, len(window), bucket_size):
            bucket = window[start:start + bucket_size]
            by_length = torch.argsort(sizes[bucket], stable=True)
            current: list[int] = []
            longest = 0
            for index, length in zip(bucket[by_length].tolist(), sizes[bucket][by_length].tolist()):
                grown = max(longest, length)
                if current and grown * (len(current) + 1) > budget:
                    batches.append(current)
                    current, grown = [], length
                current.append(index)
                longest = grown
            if current:
                batches.append(current)
        yield from (batches[k] for k in torch.randperm(len(batches), generator=generator).tolist())


def schedule_steps(
    batches: Iterable[list[int]], lengths: Sequence[int], *, dp_size: int, step_tokens: int, packed: bool = False,
    whole: bool = False,
) -> Iterator[list[list[list[int] | None]]]:
    """Arrange micro-batches into optimizer steps: step -> round -> dp rank -> sample indices.

    A round gives each data-parallel rank one micro-batch; a step takes rounds
    until ``step_tokens`` tokens (over all ranks; padded, or summed when ``packed``)
    are reached, at least one.
    Leftover micro-batches that cannot fill a round or a step are dropped: every
    rank must run the same number of micro-batches, since each issues collectives.
    With ``whole`` (an epoch: every sample once) they are kept: the last round's
    missing slots are None (fillers) and the last step may hold fewer tokens.
    """
    return _cut_steps(_rounds(batches, dp_size, whole=whole),
                      lambda round_: sum(_tokens(mb, lengths, packed) for mb in round_ if mb is not None),
                      step_tokens, keep_tail=whole)


def _rounds(batches: Iterable[list[int]], dp_size: int, *, whole: bool) -> Iterator[list[list[int] | None]]:
    """Consecutive micro-batches, ``dp_size`` a round; a last short round dropped, or with
    ``whole`` padded with fillers (None)."""
    current: list[list[int] | None] = []
    for batch in batches:
        current.append(batch)
        if len(current) == dp_size:
            yield current
            current = []
    if whole and current:
        yield current + [None] * (dp_size - len(current))


def schedule_global_steps(
    batches: Iterable[list[int]], lengths: Sequence[int], *, dp_size: int, step_tokens: int, packed: bool = False,
    whole: bool = False,
) -> Iterator[list[list[list[int] | None]]]:
    """The same optimizer steps at any data-parallel size: step -> round -> dp rank -> sample indices.

    A step takes micro-batches until ``step_tokens`` tokens, as one rank would, and deals
    them round-robin over the ranks. Since the loss divides by the step's label tokens over
    every rank, the step's loss and gradient do not depend on how its micro-batches are
    dealt, only on which they are. A rank left without a micro-batch in the last round gets
    None: a filler that keeps its collectives in step with the others and adds nothing.
    A last step short of ``step_tokens`` is dropped, or with ``whole`` (an epoch) kept.
    """
    for micro in _cut_steps(batches, lambda mb: _tokens(mb, lengths, packed), step_tokens, keep_tail=whole):
        padded = micro + [None] * (-len(micro) % dp_size)
        yield [padded[i : i + dp_size] for i in range(0, len(padded), dp_size)]


def _tokens(micro_batch: list[int], lengths: Sequence[int], packed: bool) -> int:
    """Padded tokens (count x longest), or the sum when packed into one row."""
    return sum(lengths[i] for i in micro_batch) if packed else len(micro_batch) * max(lengths[i] for i in micro_batch)


def _cut_steps(items: Iterable, size, step_tokens: int, *, keep_tail: bool = False) -> Iterator[list]:
    """Consecutive items into steps of at least ``step_tokens`` (by ``size``); a short tail is
    dropped, or kept as a last step with ``keep_tail``."""
    current, tokens = [], 0
    for item in items:
        current.append(item)
        tokens += size(item)
        if tokens >= step_tokens:
            yield current
            current, tokens = [], 0
    if keep_tail and current:
        yield current
