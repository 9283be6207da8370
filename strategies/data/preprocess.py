"""Encode dataset lines in worker processes, with an on-disk cache of tokenized samples.

A line's cache key covers its text, the processor's files and the size and
modification time of every image and video it names, so a resumed run, or a second rank,
reads the tokenized sample back instead of preprocessing it again; a change to any
of them makes a new entry. Entries are written to a temporary name and renamed, so a
crash never leaves a half-written one.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing as mp
import os
import pathlib
import sys
from typing import Any, Iterable, Iterator

import attrs
import torch

from weft.strategies.data.conversation import Sample
from weft.strategies.data.formats import media_lists
from weft.strategies.data.images import media_path
from weft.strategies.data.record_text import Unreadable
from weft.strategies.data.video import VideoLimits

#: A JSONL line longer than this is skipped and counted without being held in memory
#: (a 128K-token conversation is well under 1 MiB; images are files, not inline).
MAX_LINE_BYTES = 16 << 20

# One processor per worker process, loaded by the pool's initializer: the standard
# way to give pool workers a heavy object without pickling it per task.
_WORKER: dict[str, Any] = {}


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 1) - 1))


# Changed whenever encode_conversation gives other tokens for the same record and processor, so
# samples cached by an older weft are made again. "chat-template": rendered by the processor's
# chat template, with its default system prompt (before, weft's layout without one).
ENCODING = "chat-template"


def processor_fingerprint(folder: pathlib.Path) -> str:
    """A digest of the processor's files: its JSON configs and its chat template (.jinja),
    which decides every token of a sample."""
    digest = hashlib.sha256()
    for path in sorted([*folder.glob("*.json"), *folder.glob("*.jinja")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _init(processor: str, base: str, cache_dir: str | None, fingerprint: str, skip_pixels: int = 0,
          videos: VideoLimits = VideoLimits(), system: str | None = None, pixels: tuple[int, int] = (0, 0),
          allow_outside: bool = True) -> None:
    from weft.strategies.data.conversation import load_processor, load_video_sizing

    torch.set_num_threads(1)  # one core per worker: the pool is the parallelism
    tokenizer, image_processor = load_processor(processor, pixels=pixels)
    video_sizing = load_video_sizing(processor)
    # Frames are grouped by the processor's own temporal patch size.
    videos = attrs.evolve(videos, temporal=int(getattr(image_processor, "temporal_patch_size", 2)))
    _WORKER.update(tokenizer=tokenizer, image_processor=image_processor, base=pathlib.Path(base),
                   cache=pathlib.Path(cache_dir) if cache_dir else None, fingerprint=fingerprint,
                   skip_pixels=skip_pixels, videos=videos, system=system, video_sizing=video_sizing,
                   allow_outside=allow_outside)


def _key(line: str, record: Any, base: pathlib.Path, fingerprint: str, allow_outside: bool = True) -> str:
    digest = hashlib.sha256(line.encode() + fingerprint.encode())
    for path in sorted(_image_paths(record)):
        try:
            # A path that may not leave the folder is never looked at (its record is refused anyway).
            stat = media_path(path, base=base, allow_outside=allow_outside).stat()
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        except (OSError, ValueError):
            digest.update(f"{path}:missing".encode())
    return digest.hexdigest()


def _image_paths(record: Any) -> list[str]:
    """Every image, video and video-frame file a record names."""
    paths = []
    if isinstance(record, dict):
        try:
            lists = media_lists(record)
        except ValueError:  # both spellings: the record is refused when it is read
            lists = ()
        for value in lists:
            if isinstance(value, list):
                paths += [p for p in value if isinstance(p, str)]
        for message in record.get("messages", []) if isinstance(record.get("messages"), list) else []:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else []:
                for value in (part.get("image"), part.get("video")) if isinstance(part, dict) else ():
                    if isinstance(value, str):
                        paths.append(value)
                    elif isinstance(value, list):  # a video as frame files
                        paths += [p for p in value if isinstance(p, str)]
    return paths


def _encode(job: tuple[str, str]) -> tuple[str, Any]:
    """(where, line) -> (where, Sample) or (where, "reason"). Whatever fails in one record is that
    record's reason: a bad sample, skipped and counted, never the end of the preprocessing."""
    where, line = job
    if isinstance(line, int):
        return where, f"line of {line:,} bytes, over the {MAX_LINE_BYTES:,}-byte limit of one sample; not read"
    if isinstance(line, Unreadable):
        return where, line.reason
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return where, f"malformed JSON: {error.msg} at column {error.colno}"
    except RecursionError:  # a line of 100,000 '[': Python's parser stops at its recursion limit
        return where, f"JSON nested deeper than Python's parser reads ({sys.getrecursionlimit():,} levels)"
    cache = _WORKER["cache"]
    key = _key(line, record, _WORKER["base"], _WORKER["fingerprint"], _WORKER["allow_outside"]) if cache else None
    if key and (cache / f"{key}.pt").is_file():
        try:
            # Tensors only (weights_only): a pickle planted in a shared cache folder is refused,
            # never run, and the entry is made again below.
            return where, Sample(**torch.load(cache / f"{key}.pt", weights_only=True))
        except Exception:  # a damaged or planted entry is re-made below
            pass
    try:
        sample = _read(record)
    except Exception as error:  # a damaged image, a record of the wrong shape, a decoder's own error: this record's
        return where, f"{type(error).__name__}: {error}"
    if key:  # outside the try: a cache that cannot be written is the machine's fault, not the record's
        tmp = cache / f".{key}.{os.getpid()}.tmp"
        torch.save(attrs.asdict(sample, recurse=False), tmp)  # a dict of tensors, nothing to unpickle
        tmp.replace(cache / f"{key}.pt")
    return where, sample


def _read(record: Any) -> Sample:
    """The record's Sample; raises what its reading raises."""
    from weft.strategies.data.conversation import encode_conversation
    from weft.strategies.data.formats import record_to_messages
    from weft.strategies.data.pairs import is_pair, join_pair, pair_records

    def encoded(one: Any) -> Sample:
        messages = record_to_messages(one, base=_WORKER["base"], skip_pixels=_WORKER["skip_pixels"],
                                      videos=_WORKER["videos"], allow_outside=_WORKER["allow_outside"])
        return encode_conversation(messages, tokenizer=_WORKER["tokenizer"], image_processor=_WORKER["image_processor"],
                                   system=_WORKER["system"], video_sizing=_WORKER["video_sizing"])

    if is_pair(record):  # a preference pair: both conversations, one sample (strategies/data/pairs.py)
        chosen, rejected, reference = pair_records(record)
        return join_pair(encoded(chosen), encoded(rejected), reference=reference)
    return encoded(record)


def encoding_fingerprint(*, processor_folder: pathlib.Path, skip_pixels: int, videos: VideoLimits,
                         system: str | None, pixels: tuple[int, int] = (0, 0), allow_outside: bool = True) -> str:
    """Everything besides a line itself that decides its tokens and pixels: the processor's files,
    the pixel limit (a sample cached under a looser one is not reused), the resize budget, the video
    limits (nor one at another frame rate), the system prompt, whether files may lie outside the data
    folder (nor one made from such a file once they may not), and the version of the encoding itself.
    The default ``allow_outside`` adds nothing: stores made before the switch existed are still read."""
    return (f"{ENCODING}:{processor_fingerprint(processor_folder)}:skip_pixels={skip_pixels}:"
            f"pixels={pixels[0]}-{pixels[1]}:fps={videos.fps:g}:max_frames={videos.max_frames}:system={system!r}"
            + ("" if allow_outside else ":inside"))


def encode_lines(lines: Iterable[tuple[str, str]], *, processor: str, processor_folder: pathlib.Path,
                 base: pathlib.Path, workers: int, cache_dir: pathlib.Path | None, skip_pixels: int = 0,
                 videos: VideoLimits = VideoLimits(), system: str | None = None,
                 pixels: tuple[int, int] = (0, 0), allow_outside: bool = True) -> Iterator[tuple[str, Any]]:

    """Encode (where, JSON line) jobs in order; yields (where, Sample) or (where, reason)."""
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = encoding_fingerprint(processor_folder=processor_folder, skip_pixels=skip_pixels, videos=videos,
                                       system=system, pixels=pixels, allow_outside=allow_outside)
    args = (processor, str(base), str(cache_dir) if cache_dir else None, fingerprint, skip_pixels, videos, system,
            pixels, allow_outside)
    if workers <= 1:
        _init(*args)
        yield from map(_encode, lines)
        return
    # fork shares the parent's imports (fast start); a process that has touched CUDA
    # must not fork, so it spawns its workers instead.
    method = "spawn" if torch.cuda.is_available() and torch.cuda.is_initialized() else "fork"
    with mp.get_context(method).Pool(workers, initializer=_init, initargs=args) as pool:
        for where, out in pool.imap(_encode_to_bytes, lines, chunksize=4):
            yield where, Sample(**torch.load(io.BytesIO(out), weights_only=True)) if isinstance(out, bytes) else out


def _encode_to_bytes(job: tuple[str, str | int]) -> tuple[str, Any]:
    """A pool worker's `_encode`, its sample as bytes. A tensor returned through a pool travels
    as a file descriptor of shared memory (torch's multiprocessing reductions), open for as long
    as the sample is held: 12,000 image samples on a 16-core host ran out of descriptors
    ("received 0 items of ancdata") and hung the pool. Bytes are copied by value, and read back
    with weights_only: tensors and nothing else."""
    where, out = _encode(job)
    if not isinstance(out, Sample):
        return where, out
    buffer = io.BytesIO()
    torch.save(attrs.asdict(out, recurse=False), buffer)
    return where, buffer.getvalue()
