"""Preprocessed samples on disk: safetensors shards that every rank reads by sample.

A store is one folder of shards ``shard-00000.safetensors``, ``shard-00001...``, each with a
sidecar ``shard-00000.json`` (the lines it covers, its samples' token counts, the bad lines
among them and the shard file's size), and ``done.json`` once every line is in. A shard is
columnar: one tensor a field of ``Sample`` (every sample's ``input_ids`` end to end, every
image's patches end to end, ...) and ``rows``, (samples, fields): how many rows of each field
each sample has (-1: the field is absent). A sample is a slice of each, read by offset.

- Reading: the index only (``index.json`` and ``lengths.i32``, gathered from the sidecars once
  complete: token counts for the batching, 4 bytes a sample); a sample's
  tensors are read from its shard (by offset) when it is batched, so a rank's host memory is
  the micro-batches in flight, not the dataset, and the time to the first step does not grow
  with the dataset once it is preprocessed.
- Writing: a shard goes to a temporary name and is renamed, then its sidecar: a crash leaves
  complete shards and at most one temporary file. Building again resumes after the last complete
  shard (its sidecar names the lines it covers); a shard whose file is missing, or whose size or
  header does not match its sidecar, is made again from its first line on, with every shard
  after it.

safetensors, not torch.save: no pickle is ever read back (a planted file cannot run code), the
format is the one model weights ship in, and a tensor's rows are a byte range of the file,
read by offset (``_Shard``). Arrow (Hugging Face ``datasets``) would add pyarrow for a
columnar layout this needs none of: a sample is read whole, by index.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import fcntl
import itertools
import json
import os
import pathlib
import struct
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Sequence

import attrs
import torch
from safetensors.torch import save_file

from weft.strategies.data.conversation import Sample

#: The store layout's version: part of the store's name, so a change makes new stores.
FORMAT = 3  # 3: a preference pair's two fields (Sample.pair_split, reference_logps)
FIELDS = tuple(field.name for field in attrs.fields(Sample))
#: A shard is closed at this many bytes of tensors (or SHARD_SAMPLES samples): small enough
#: that a killed preprocessing loses little, large enough that a million samples are a few
#: hundred files.
SHARD_BYTES = 256 << 20
SHARD_SAMPLES = 4096
#: Open shard files kept by one reader (each holds a file descriptor).
OPEN_SHARDS = 32


def _name(index: int) -> str:
    return f"shard-{index:05d}"


def _write_json(path: pathlib.Path, value) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def complete(folder: pathlib.Path) -> bool:
    return (folder / "done.json").is_file()


def _shard_ok(folder: pathlib.Path, side: dict) -> bool:
    """The shard file is there, of the size its sidecar recorded, and its header reads."""
    path = folder / side["file"]
    try:
        if path.stat().st_size != side["bytes"]:
            return False
        shard = _Shard(path, rows=False)  # its header read, and its row table's shape checked
        shard.close()
        if shard.tensors["rows"]["shape"][0] != side["samples"]:
            return False
    except Exception:  # missing, truncated or overwritten: made again
        return False
    return True


def _sidecars(folder: pathlib.Path) -> list[dict]:
    """The complete shards' sidecars in order, up to the first missing or damaged one."""
    sides = []
    while (path := folder / f"{_name(len(sides))}.json").is_file():
        try:
            side = json.loads(path.read_text())
        except (OSError, ValueError):
            break
        if not _shard_ok(folder, side):
            break
        sides.append(side)
    return sides


@contextlib.contextmanager
def _locked(folder: pathlib.Path):
    """One builder at a time (two runs over one dataset): the second waits, then finds it done."""
    with open(folder / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(folder: pathlib.Path, *, lines: Iterable[tuple[str, str]],
          encode: Callable[[Iterable[tuple[str, str]]], Iterator[tuple[str, object]]],
          log=None, shard_bytes: int = SHARD_BYTES, shard_samples: int = SHARD_SAMPLES) -> Index:
    """Encode ``lines`` ((where, line) jobs) through ``encode`` (yields (where, Sample) or
    (where, reason)) into the store at ``folder``, resuming after its complete shards. Returns
    the complete store's index, checked (``SampleStore(folder, index=...)`` opens it)."""
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        index = _read_index(folder)
        if index is not None:
            return index
        sides = _sidecars(folder)
        if complete(folder) and len(sides) == json.loads((folder / "done.json").read_text())["shards"]:
            return _write_index(folder, sides)
        (folder / "done.json").unlink(missing_ok=True)
        for stale in folder.glob(".*.tmp"):  # a killed build's half-written shard
            stale.unlink()
        for later in folder.glob("shard-*.json"):  # after a damaged shard: made again
            if int(later.stem.split("-")[1]) >= len(sides):
                later.unlink()
        done = sides[-1]["lines_end"] if sides else 0
        if log is not None and sides:
            log.info("data.preprocess_resumed", shards=len(sides), lines=done, folder=str(folder))
        writer = _Writer(folder, index=len(sides), lines_end=done, shard_bytes=shard_bytes,
                         shard_samples=shard_samples)
        remaining = (job for number, job in enumerate(lines) if number >= done)
        for where, result in encode(remaining):
            writer.add(where, result)
        writer.close()
        _write_json(folder / "done.json", {"shards": writer.index, "lines": writer.lines_end})
        return _write_index(folder, _sidecars(folder))


@attrs.frozen
class Index:
    """A complete store at a glance: its shard files, their sizes and samples, the bad lines, and
    every sample's token count (``array('i')``: 4 bytes a sample, read in one piece)."""

    files: list[str]
    sizes: list[int]
    samples: list[int]
    bad: list[tuple[str, str]]
    lengths: array.array


def _write_index(folder: pathlib.Path, sides: list[dict]) -> Index:
    """The sidecars gathered into ``index.json`` and ``lengths.i32`` (the next start reads those
    two files, not a sidecar a shard: a million samples' counts as JSON cost a start 0.06 s)."""
    lengths = array.array("i", (n for side in sides for n in side["lengths"]))
    index = Index(files=[side["file"] for side in sides], sizes=[side["bytes"] for side in sides],
                  samples=[side["samples"] for side in sides],
                  bad=[tuple(entry) for side in sides for entry in side["bad"]], lengths=lengths)
    tmp = folder / f".lengths.{os.getpid()}.tmp"
    tmp.write_bytes(lengths.tobytes())
    tmp.replace(folder / "lengths.i32")
    _write_json(folder / "index.json", {"files": index.files, "sizes": index.sizes, "samples": index.samples,
                                        "bad": index.bad, "lengths_bytes": len(lengths) * lengths.itemsize})
    return index


def _read_index(folder: pathlib.Path) -> Index | None:
    """The complete store's index, each shard's size and header checked; None when there is
    none, or a shard is missing or damaged (the sidecars then say which)."""
    if not complete(folder):
        return None
    try:
        found = json.loads((folder / "index.json").read_text())
        raw = (folder / "lengths.i32").read_bytes()
        if len(raw) != found["lengths_bytes"] or len(found["files"]) != json.loads(
                (folder / "done.json").read_text())["shards"]:
            return None
        for name, size, samples in zip(found["files"], found["sizes"], found["samples"]):
            if not _shard_ok(folder, {"file": name, "bytes": size, "samples": samples}):
                return None
    except (OSError, ValueError, KeyError):
        return None
    lengths = array.array("i")
    lengths.frombytes(raw)
    return Index(files=found["files"], sizes=found["sizes"], samples=found["samples"],
                 bad=[tuple(entry) for entry in found["bad"]], lengths=lengths)


class _Writer:
    def __init__(self, folder: pathlib.Path, *, index: int, lines_end: int, shard_bytes: int,
                 shard_samples: int) -> None:
        self.folder, self.index, self.lines_end = folder, index, lines_end
        self.shard_bytes, self.shard_samples = shard_bytes, shard_samples
        self._reset()

    def _reset(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {field: [] for field in FIELDS}
        self.rows: list[list[int]] = []
        self.lengths: list[int] = []
        self.bad: list[list[str]] = []
        self.size = 0
        self.first = self.lines_end

    def add(self, where: str, result) -> None:
        self.lines_end += 1
        if not isinstance(result, Sample):
            self.bad.append([where, str(result)])
        else:
            rows = []
            for field in FIELDS:
                value = getattr(result, field)
                rows.append(-1 if value is None else int(value.shape[0]))
                if value is not None:
                    self.parts[field].append(value)
                    self.size += value.numel() * value.element_size()
            self.rows.append(rows)
            self.lengths.append(result.num_tokens)
        if self.size >= self.shard_bytes or len(self.lengths) >= self.shard_samples:
            self.flush()

    def flush(self) -> None:
        if self.lines_end == self.first:
            return
        name = _name(self.index)
        path = self.folder / f"{name}.safetensors"
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        # One tensor a field, the samples end to end (a copy of its own: safetensors refuses
        # tensors that share storage); an all-bad shard is still a file, its sidecar needs a size.
        tensors = {field: torch.cat(parts).contiguous() for field, parts in self.parts.items() if parts}
        tensors["rows"] = torch.tensor(self.rows, dtype=torch.long).reshape(-1, len(FIELDS))
        save_file(tensors, str(tmp))
        tmp.replace(path)
        _write_json(self.folder / f"{name}.json", {
            "file": path.name, "bytes": path.stat().st_size, "samples": len(self.lengths),
            "lines_start": self.first, "lines_end": self.lines_end, "lengths": self.lengths, "bad": self.bad,
        })
        self.index += 1
        self._reset()

    def close(self) -> None:
        self.flush()


#: safetensors' dtype names (its format's header) -> torch's.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _Shard:
    """One open shard: its file, each tensor's place in it, and each sample's first row and row
    count in every field.

    Read with ``pread`` into tensors of their own, not through ``safe_open``'s mapping: a mapped
    shard's pages count in the reading process's resident memory (with the kernel's read-ahead
    around every fault: +190 MiB for a 100,000-sample run's five steps, against the 1,000-sample
    one), so a rank would look larger the larger the dataset. The format is safetensors' own: an
    8-byte little-endian header size, a JSON header of dtype/shape/data_offsets, the bytes."""

    def __init__(self, path: pathlib.Path, *, rows: bool = True) -> None:
        """``rows``: read the row table (to read samples); without, the header only (a check)."""
        self.fd = os.open(path, os.O_RDONLY)
        try:
            (size,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            header = json.loads(os.pread(self.fd, size, 8))
        except Exception:
            os.close(self.fd)
            raise
        self.base = 8 + size
        self.tensors = {name: info for name, info in header.items() if name != "__metadata__"}
        if not rows:
            return
        self.counts = self.read("rows")  # (samples, fields), -1 = absent
        present = self.counts.clamp(min=0)
        self.starts = present.cumsum(0) - present  # (samples, fields)

    def read(self, name: str, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Rows [start, start + count) of tensor ``name`` (all of it by default), read from the file."""
        info = self.tensors[name]
        shape, dtype = info["shape"], _DTYPES[info["dtype"]]
        count = shape[0] - start if count is None else count
        out = torch.empty((count, *shape[1:]), dtype=dtype)
        row = out[0].numel() * out.element_size() if count else 0
        if count and row:
            view = out.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes, filled in place
            got = os.preadv(self.fd, [view], self.base + info["data_offsets"][0] + start * row)
            if got != count * row:
                raise OSError(f"shard truncated: {name} rows {start}..{start + count}")
        return out

    def fields(self, slot: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        counts, starts = self.counts[slot].tolist(), self.starts[slot].tolist()
        out = {}
        for name in names:
            f = FIELDS.index(name)
            if counts[f] >= 0:
                out[name] = self.read(name, starts[f], counts[f])
        return out

    def close(self) -> None:
        os.close(self.fd)


class SampleStore(Sequence):
    """A complete store, read by index: ``store[i]`` is the i-th good sample, sliced from its
    shard's file; ``token_counts`` and ``bad`` come from its index without reading a shard."""

    def __init__(self, folder: pathlib.Path, *, index: Index | None = None) -> None:
        """``index``: the one ``build`` just checked (else read and checked here)."""
        if not complete(folder):
            raise ValueError(f"{folder}: preprocessing has not finished")
        if index is None:
            index = _read_index(folder)
        if index is None:
            sides = _sidecars(folder)
            if len(sides) != json.loads((folder / "done.json").read_text())["shards"]:
                raise ValueError(f"{folder}: a shard is missing or damaged")
            index = _write_index(folder, sides)
        self.folder = folder
        self.token_counts = index.lengths
        self.bad = index.bad
        self._files = index.files
        self._first = list(itertools.accumulate(index.samples, initial=0))[:-1]  # a sample's shard by bisection
        self._open: OrderedDict[int, _Shard] = OrderedDict()

    def __len__(self) -> int:
        return len(self.token_counts)

    def _shard(self, shard: int) -> _Shard:
        """The shard, opened (the most recently used OPEN_SHARDS kept open)."""
        entry = self._open.pop(shard, None)
        if entry is None:
            entry = _Shard(self.folder / self._files[shard])
            if len(self._open) >= OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()  # its samples are copies: nothing refers to it
        self._open[shard] = entry  # the most recently used last
        return entry

    def fields(self, index: int, names: Sequence[str] = FIELDS) -> dict[str, torch.Tensor]:
        """The sample's tensors of ``names`` (those it has), nothing else read."""
        shard = bisect.bisect_right(self._first, index) - 1
        return self._shard(shard).fields(index - self._first[shard], names)

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return Sample(**self.fields(index % len(self)))


class SampleView(Sequence):
    """Some of a store's (or a view's) samples (``indices``), a few of them replaced
    (``overlay``: a truncated sample), with their token counts: what the checks and cuts of a
    run leave."""

    def __init__(self, base: Sequence[Sample], indices: list[int], overlay: dict[int, Sample] | None = None) -> None:
        self.base, self.indices, self.overlay = base, indices, overlay or {}
        counts = token_counts(base)
        self.token_counts = [self.overlay[i].num_tokens if i in self.overlay else counts[i] for i in indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> Sample:
        i = self.indices[k]
        return self.overlay[i] if i in self.overlay else self.base[i]


def token_counts(samples: Sequence[Sample]) -> list[int]:
    """Each sample's tokens, from a store's sidecars where it has them (nothing read)."""
    counts = getattr(samples, "token_counts", None)
    return counts if counts is not None else [s.num_tokens for s in samples]


def remembered(store: SampleStore, name: str, compute: Callable[[], dict]) -> dict:
    """``compute()``'s answer about a complete store, kept as ``name``.json beside its shards:
    what a run finds about its samples once (a check over every sample) the next run reads."""
    path = store.folder / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        found = compute()
        _write_json(path, found)
        return found
