"""Files written whole or not at all: under a temporary name beside the target, renamed
over it once complete (a rename within a folder is atomic on POSIX). A reader (a resumed
script, `weft report`, a watcher polling a run directory) sees the old file or the new
one, never half of one; a write that fails leaves no temporary file behind."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from typing import IO, Any


@contextlib.contextmanager
def written_whole(path: str | os.PathLike, *, mode: str = "w") -> Iterator[IO]:
    """``path`` opened for writing (``mode`` "w" text, "wb" bytes); renamed into place when
    the block ends without an error, deleted otherwise."""
    path = pathlib.Path(path)
    # The pid keeps two processes writing one path (ranks, a second run) off each other's file.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as out:
            yield out
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_json_whole(path: str | os.PathLike, value: Any, *, indent: int | None = None) -> None:
    with written_whole(path) as out:
        out.write(json.dumps(value, indent=indent))


def write_lines_whole(path: str | os.PathLike, lines: Iterator[str] | list[str]) -> None:
    """Each of ``lines`` (no newline of their own) on a line of its own."""
    with written_whole(path) as out:
        out.writelines(line + "\n" for line in lines)
