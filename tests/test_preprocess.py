"""Preprocessing in worker processes and the on-disk cache of tokenized samples."""

from __future__ import annotations

import os
import time

import pytest
import torch

from test_bad_data import make_dataset
from weft.strategies.data import datasets


def encode(path, *, workers, cache):
    out = list(datasets.jsonl_samples(path, processor="tiny_vl", workers=workers, cache_dir=cache))
    return out


def test_workers_and_cache_give_the_same_samples(tmp_path):
    path, bad_lines = make_dataset(tmp_path)
    cache = tmp_path / "cache"
    plain = encode(path, workers=1, cache=None)
    parallel = encode(path, workers=2, cache=cache)
    assert len(plain) == len(parallel)
    for a, b in zip(plain, parallel):
        assert type(a) is type(b)
        if isinstance(a, datasets.BadSample):
            assert (a.where, a.reason) == (b.where, b.reason)
        else:
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            # Copied out of the pool by value: a tensor in shared memory holds a file descriptor
            # while the sample lives, and a large dataset ran out of them (the pool then hung).
            assert not any(t.is_shared() for t in (b.input_ids, b.labels, b.pixel_values) if t is not None)
            assert (a.pixel_values is None) == (b.pixel_values is None)
            if a.pixel_values is not None:
                assert torch.equal(a.pixel_values, b.pixel_values)
    good = sum(not isinstance(s, datasets.BadSample) for s in plain)
    entries = sorted(cache.glob("*.pt"))
    assert len(entries) == len(set(e.name for e in entries)) and 0 < len(entries) <= good
    assert not list(cache.glob(".*.tmp"))  # written atomically

    # A second pass reads the cache: remove the images and the good samples still come back.
    before = {e.name: e.stat().st_mtime_ns for e in entries}
    again = encode(path, workers=1, cache=cache)
    assert sum(not isinstance(s, datasets.BadSample) for s in again) == good
    assert {e.name: e.stat().st_mtime_ns for e in cache.glob("*.pt")} == before

    # Touching an image changes the key: that sample is preprocessed again.
    red = tmp_path / "images" / "red.png"
    os.utime(red, ns=(time.time_ns(), time.time_ns() + 10**9))
    encode(path, workers=1, cache=cache)
    assert len(list(cache.glob("*.pt"))) > len(before)


class _Planted:
    """Unpickling this touches a file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


@pytest.mark.quick  # workers=1: no pool
def test_pickle_planted_in_the_cache_is_refused(tmp_path):
    """A cache folder beside a shared dataset must not be a way to run code in every job
    that reads it: entries load as tensors only; a planted one is made again, never run."""
    path, _ = make_dataset(tmp_path)
    cache = tmp_path / "cache"
    first = [s for s in encode(path, workers=1, cache=cache) if not isinstance(s, datasets.BadSample)]
    marker = tmp_path / "code-ran"
    for entry in cache.glob("*.pt"):
        torch.save(_Planted(marker), entry)
    again = [s for s in encode(path, workers=1, cache=cache) if not isinstance(s, datasets.BadSample)]
    assert not marker.exists()
    assert [s.input_ids.tolist() for s in again] == [s.input_ids.tolist() for s in first]
    for entry in cache.glob("*.pt"):  # made again, as plain tensors
        assert set(torch.load(entry, weights_only=True)) >= {"input_ids", "labels"}
