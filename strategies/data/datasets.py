"""Turn the recipe's data section into encoded samples; bad samples are skipped and counted."""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Iterator

from weft.strategies.data.conversation import Sample, encode_conversation


class BadSample(Exception):
    """A sample that cannot be used; carries where it came from."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class DataFileError(ValueError):
    """The data file as a whole cannot be read (not one bad sample): the user's error."""


def synthetic_samples(
    *, seed: int, num_samples: int, min_side: int, max_side: int, tokenizer: Any, image_processor: Any,
    videos: tuple[tuple[int, int, int], ...] = (), system: str | None = None, video_sizing: Any = None,
) -> Iterator[Sample | BadSample]:
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    for conversation in synthetic_conversations(
        seed=seed, num_samples=num_samples, min_side=min_side, max_side=max_side, videos=videos
    ):
        yield encode_conversation(conversation.messages, tokenizer=tokenizer, image_processor=image_processor,
                                  system=system, video_sizing=video_sizing)


def jsonl_samples(
    path: pathlib.Path, *, processor: str, workers: int = 1, cache_dir: pathlib.Path | None = None,
    skip_pixels: int = 0, videos: Any = None, system: str | None = None, pixels: tuple[int, int] = (0, 0),
) -> Iterator[Sample | BadSample]:
    """JSONL in the chat or sharegpt-style format (``data_formats``), one record per line,
    encoded in ``workers`` processes (``preprocess``), tokenized samples cached in ``cache_dir``.

    A line that cannot become a sample, for whatever reason, is a BadSample naming
    its file:line and the reason; blank lines are not samples.
    """
    from weft.strategies.data.conversation import processor_dir
    from weft.strategies.data.preprocess import encode_lines
    from weft.strategies.data.video import VideoLimits

    for where, result in encode_lines(jsonl_lines(path), processor=processor, processor_folder=processor_dir(processor),
                                      base=path.parent, workers=workers, cache_dir=cache_dir,
                                      skip_pixels=skip_pixels, videos=videos or VideoLimits(), system=system,
                                      pixels=pixels):

        yield result if isinstance(result, Sample) else BadSample(where, result)


def jsonl_lines(path: pathlib.Path) -> Iterator[tuple[str, str | int]]:
    """(file:line, the line) for every non-blank line; an oversized one as its size in bytes
    (``_encode`` reports it; nothing else of it is kept). A ``.json`` file is one JSON array of
    records, as LLaVA ships its instruction data: (file:record N, the record as one line)."""
    from weft.strategies.data.preprocess import MAX_LINE_BYTES

    if path.suffix == ".json":
        yield from _array_records(path)
        return
    with path.open("rb") as handle:
        for number, line in enumerate(_bounded_lines(handle, limit=MAX_LINE_BYTES), start=1):
            if isinstance(line, int) or line.strip():
                yield f"{path}:{number}", line if isinstance(line, int) else line.decode("utf-8", "replace")


def _array_records(path: pathlib.Path) -> Iterator[tuple[str, str]]:
    """A JSON array file's records, numbered from 1. The whole array is parsed at once (by the
    process that preprocesses: rank 0), so an array file is bounded by that process's memory;
    JSONL is read a line at a time."""
    import json

    try:
        records = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        raise DataFileError(f"data.path {str(path)!r}: not a JSON array file ({error.msg} at line {error.lineno}, "
                        f"column {error.colno}); a .json file holds one array of records, a .jsonl file one record "
                        "a line") from None
    if not isinstance(records, list):
        raise DataFileError(f"data.path {str(path)!r}: a .json file holds one JSON array of records; this one "
                            f"holds a {type(records).__name__} (one record a line: name the file .jsonl)")
    for number, record in enumerate(records, start=1):
        yield f"{path}:record {number}", json.dumps(record)


def jsonl_store(path: pathlib.Path, *, processor: str, cache_dir: pathlib.Path, workers: int = 1,
                skip_pixels: int = 0, videos: Any = None, system: str | None = None, log=None,
                pixels: tuple[int, int] = (0, 0)):
    """The JSONL file preprocessed into a store of shards in ``cache_dir`` (strategies/data/
    shards.py), made or resumed here, then opened. The store is named by the data file (its
    path, size and modification time) and by everything that decides its tokens
    (``encoding_fingerprint``); stores of an older version of the file are removed once the new
    one is complete. An image or video file changed in place after preprocessing is not seen:
    touch the data file (or remove the cache) to preprocess it again."""
    import hashlib
    import shutil

    from weft.strategies.data import shards
    from weft.strategies.data.conversation import processor_dir
    from weft.strategies.data.preprocess import encode_lines, encoding_fingerprint
    from weft.strategies.data.video import VideoLimits

    videos = videos or VideoLimits()
    stat = path.stat()
    data_key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    fingerprint = encoding_fingerprint(processor_folder=processor_dir(processor), skip_pixels=skip_pixels,
                                       videos=videos, system=system, pixels=pixels)
    encoding_key = hashlib.sha256(f"{fingerprint}:shards={shards.FORMAT}".encode()).hexdigest()[:12]
    folder = cache_dir / f"shards-{data_key}-{encoding_key}"

    def encode(jobs):
        return encode_lines(jobs, processor=processor, processor_folder=processor_dir(processor), base=path.parent,
                            workers=workers, cache_dir=None, skip_pixels=skip_pixels, videos=videos, system=system,
                            pixels=pixels)

    sides = shards.build(folder, lines=jsonl_lines(path), encode=encode, log=log)
    for old in cache_dir.glob("shards-*"):  # an older version of the data file: never read again
        if old.is_dir() and not old.name.startswith(f"shards-{data_key}-"):
            shutil.rmtree(old, ignore_errors=True)
    return shards.SampleStore(folder, sides=sides)


def _bounded_lines(handle, *, limit: int) -> Iterator[bytes | int]:
    """The file's lines as bytes; a line over ``limit`` bytes as its length (an int), read
    through in 1 MiB pieces and dropped."""
    while line := handle.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):  # whole (the newline may be byte limit + 1)
            yield line
            continue
        size = len(line)
        while not line.endswith(b"\n") and (line := handle.readline(1 << 20)):
            size += len(line)
        yield size


def collect(samples: Iterator[Sample | BadSample], *, on_bad: Callable[[BadSample], None]) -> list[Sample]:
    kept = []
    for sample in samples:
        if isinstance(sample, BadSample):
            on_bad(sample)
        else:
            kept.append(sample)
    return kept
