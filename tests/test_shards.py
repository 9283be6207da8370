"""Preprocessed samples on disk (strategies/data/shards.py): the store gives back every sample
the in-memory path gives, bit for bit, and the same bad lines; a killed preprocessing resumes
after its last complete shard without encoding those lines again; a damaged shard is made
again; the reader maps the shards and reads only the samples asked for."""

from __future__ import annotations

import json

import pytest
import torch

from test_bad_data import make_dataset
from weft.strategies.data import datasets, shards

pytestmark = pytest.mark.quick


def _counting(path, calls):
    """The store's encoder over ``path`` (one process), counting the lines it is given."""
    from weft.strategies.data.conversation import processor_dir
    from weft.strategies.data.preprocess import encode_lines

    def encode(jobs):
        def counted():
            for job in jobs:
                calls.append(job[0])
                yield job

        return encode_lines(counted(), processor="tiny_vl", processor_folder=processor_dir("tiny_vl"),
                            base=path.parent, workers=1, cache_dir=None)

    return encode


def _same(a, b):
    for field in shards.FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), field


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data"))


def test_the_store_gives_the_in_memory_samples_and_bad_lines(dataset, tmp_path):
    path, bad_lines = dataset
    plain = list(datasets.jsonl_samples(path, processor="tiny_vl"))
    store = datasets.jsonl_store(path, processor="tiny_vl", cache_dir=tmp_path / "cache", workers=2)
    good = [s for s in plain if not isinstance(s, datasets.BadSample)]
    assert len(store) == len(good) and list(store.token_counts) == [s.num_tokens for s in good]
    for a, b in zip(good, store):
        _same(a, b)
    assert store.bad == [(s.where, s.reason) for s in plain if isinstance(s, datasets.BadSample)]
    assert {int(where.rsplit(":", 1)[1]) for where, _ in store.bad} == set(bad_lines)
    # Opened again: nothing encoded, the same samples.
    again = datasets.jsonl_store(path, processor="tiny_vl", cache_dir=tmp_path / "cache")
    _same(again[3], store[3])
    assert again[-1].num_tokens == store.token_counts[-1]


def test_a_killed_preprocessing_resumes_after_its_last_complete_shard(dataset, tmp_path):
    path, _ = dataset
    folder = tmp_path / "store"
    lines = list(datasets.jsonl_lines(path))
    calls: list[str] = []

    def killed(jobs):  # the encoder dies on the 8th line, as a killed process would stop
        for n, out in enumerate(_counting(path, calls)(jobs)):
            if n == 7:
                raise KeyboardInterrupt
            yield out

    with pytest.raises(KeyboardInterrupt):
        shards.build(folder, lines=iter(lines), encode=killed, shard_samples=3)
    assert not shards.complete(folder)
    done = json.loads(sorted(folder.glob("shard-*.json"))[-1].read_text())["lines_end"]
    assert 0 < done < 8
    calls.clear()
    shards.build(folder, lines=iter(lines), encode=_counting(path, calls), shard_samples=3)
    assert calls == [where for where, _ in lines[done:]]  # the complete shards' lines never again
    store = shards.SampleStore(folder)
    whole = shards.SampleStore(_built(path, tmp_path / "whole"))
    assert len(store) == len(whole) and store.bad == whole.bad
    for i in range(len(store)):
        _same(store[i], whole[i])


def _built(path, folder):
    shards.build(folder, lines=datasets.jsonl_lines(path), encode=_counting(path, []), shard_samples=3)
    return folder


@pytest.mark.parametrize("damage", ["truncated", "missing", "garbled-header"])
def test_a_damaged_shard_is_made_again(dataset, tmp_path, damage):
    path, _ = dataset
    folder = _built(path, tmp_path / "store")
    before = shards.SampleStore(folder)
    # Copies: a store's tensors are views of its mapped files, which the damage below rewrites in place.
    reference = [{f: t.clone() for f, t in before.fields(i).items()} for i in range(len(before))]
    del before
    target = folder / "shard-00001.safetensors"
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "missing":
        target.unlink()
    else:
        target.write_bytes(b"\xff" * 16 + target.read_bytes()[16:])
    with pytest.raises(ValueError, match="missing or damaged"):
        shards.SampleStore(folder)
    calls: list[str] = []
    shards.build(folder, lines=datasets.jsonl_lines(path), encode=_counting(path, calls), shard_samples=3)
    first = json.loads((folder / "shard-00001.json").read_text())["lines_start"]
    lines = list(datasets.jsonl_lines(path))
    assert calls == [where for where, _ in lines[first:]]  # shard 0 kept, shard 1 on made again
    store = shards.SampleStore(folder)
    assert len(store) == len(reference)
    for a, b in zip(reference, store):
        _same(datasets.Sample(**a), b)


def test_the_reader_reads_only_the_samples_asked_for(dataset, tmp_path):
    """A sample is its shard's tensors, read from the mapping on demand: the token counts come
    from the sidecars (no shard opened), and ``fields`` reads the ids without the pixels."""
    path, _ = dataset
    store = shards.SampleStore(_built(path, tmp_path / "store"))
    assert store.token_counts and not store._open  # nothing mapped to know the lengths
    picked = store.fields(0, ("input_ids", "image_grid_thw"))
    assert set(picked) == {"input_ids", "image_grid_thw"}
    assert len(store._open) == 1
    view = shards.SampleView(store, [2, 0])
    assert view.token_counts == [store.token_counts[2], store.token_counts[0]]
    _same(view[1], store[0])


def test_tensors_outlive_their_shard_leaving_the_open_set_and_shared_storage_is_written(tmp_path, monkeypatch):
    """A sample read from a shard stays valid after the reader closes that shard (only so many
    stay open); a sample whose labels are its ids (one storage) is written as two tensors."""
    import gc

    from weft.strategies.data.conversation import Sample

    def encode(_jobs):
        for n in range(12):
            ids = torch.full((5,), n)
            yield f"made:{n}", Sample(input_ids=ids, labels=ids)

    shards.build(tmp_path / "store", lines=iter(()), encode=encode, shard_samples=2)
    monkeypatch.setattr(shards, "OPEN_SHARDS", 1)
    store = shards.SampleStore(tmp_path / "store")
    first = store[0]
    later = [store[i] for i in (3, 7, 11)]
    gc.collect()
    assert len(store._open) == 1 and len(store) == 12
    assert first.input_ids.tolist() == [0] * 5 and first.labels.tolist() == [0] * 5
    assert [s.input_ids[0].item() for s in later] == [3, 7, 11]
