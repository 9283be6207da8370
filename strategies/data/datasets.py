"""Turn the recipe's data section into encoded samples; bad samples are skipped and counted."""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Iterator

from weft.strategies.data import record_files
from weft.strategies.data.conversation import Sample, encode_conversation
from weft.strategies.data.record_files import DataFileError

__all__ = ["BadSample", "DataFileError", "collect", "jsonl_lines", "jsonl_samples", "jsonl_store", "synthetic_samples"]


class BadSample(Exception):
    """A sample that cannot be used; carries where it came from."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


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
    split: str = "train", allow_outside: bool = True,
) -> Iterator[Sample | BadSample]:
    """JSONL in the chat or sharegpt-style format (``data_formats``), one record per line,
    encoded in ``workers`` processes (``preprocess``), tokenized samples cached in ``cache_dir``.

    A line that cannot become a sample, for whatever reason, is a BadSample naming
    its file:line and the reason; blank lines are not samples. ``allow_outside`` false: an image
    or video path that leaves the data file's folder is such a reason (data.allow_outside).
    """
    from weft.strategies.data.conversation import processor_dir
    from weft.strategies.data.preprocess import encode_lines
    from weft.strategies.data.video import VideoLimits

    for where, result in encode_lines(jsonl_lines(path, split=split), processor=processor,
                                      processor_folder=processor_dir(processor),
                                      base=record_files.base_of(path), workers=workers, cache_dir=cache_dir,
                                      skip_pixels=skip_pixels, videos=videos or VideoLimits(), system=system,
                                      pixels=pixels, allow_outside=allow_outside):

        yield result if isinstance(result, Sample) else BadSample(where, result)


def jsonl_lines(path: pathlib.Path, *, split: str = "train") -> Iterator[tuple[str, str | int]]:
    """(where, the record as one JSON line) for every record of the data file or folder
    (strategies/data/record_files.py: JSONL, a JSON array, CSV, parquet, a saved ``datasets``
    dataset, a folder of them); an oversized JSONL line as its size in bytes (``_encode``
    reports it; nothing else of it is kept)."""
    from weft.strategies.data.preprocess import MAX_LINE_BYTES

    return record_files.records(path, split=split, max_line_bytes=MAX_LINE_BYTES)


def jsonl_store(path: pathlib.Path, *, processor: str, cache_dir: pathlib.Path, workers: int = 1,
                skip_pixels: int = 0, videos: Any = None, system: str | None = None, log=None,
                pixels: tuple[int, int] = (0, 0), split: str = "train", allow_outside: bool = True):
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
    data_key = record_files.data_key(path)
    fingerprint = encoding_fingerprint(processor_folder=processor_dir(processor), skip_pixels=skip_pixels,
                                       videos=videos, system=system, pixels=pixels, allow_outside=allow_outside)
    # The split read is part of how the data is read: two splits' stores live side by side.
    encoding_key = hashlib.sha256(f"{fingerprint}:shards={shards.FORMAT}:split={split}".encode()).hexdigest()[:12]
    folder = cache_dir / f"shards-{data_key}-{encoding_key}"

    def encode(jobs):
        return encode_lines(jobs, processor=processor, processor_folder=processor_dir(processor),
                            base=record_files.base_of(path), workers=workers, cache_dir=None, skip_pixels=skip_pixels,
                            videos=videos, system=system, pixels=pixels, allow_outside=allow_outside)

    index = shards.build(folder, lines=jsonl_lines(path, split=split), encode=encode, log=log)
    for old in cache_dir.glob("shards-*"):  # an older version of the data file: never read again
        if old.is_dir() and not old.name.startswith(f"shards-{data_key}-"):
            shutil.rmtree(old, ignore_errors=True)
    return shards.SampleStore(folder, index=index)


def collect(samples: Iterator[Sample | BadSample], *, on_bad: Callable[[BadSample], None]) -> list[Sample]:
    kept = []
    for sample in samples:
        if isinstance(sample, BadSample):
            on_bad(sample)
        else:
            kept.append(sample)
    return kept
