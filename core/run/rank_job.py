"""Commands that run a recipe on N local ranks and report rank 0's result (`weft check`,
`weft eval`, `weft generate`): the parent starts the ranks of a hidden worker command and
reads what rank 0 writes (JSON, or the job's own files); each rank runs one function inside
its process group."""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Any, Callable

from weft.core.errors import EXIT_GUARD, EXIT_USER, RunFailed, WeftError
from weft.core.recipe import Recipe
from weft.core.run.rank_errors import note, noted
from weft.core.whole_files import write_json_whole


def launch_ranks(command: str, *, nproc: int, args: list[str], out: pathlib.Path) -> None:
    """Start ``nproc`` ranks of ``weft _<command>-worker ARGS --out OUT``; RunFailed unless
    they all end well and ``out`` was written."""
    from weft.core.run.launch import launch_local

    code = launch_local(nproc=nproc, args=["-m", "weft", f"_{command}-worker", *args, "--out", str(out)])
    error = noted(folder=out.parent, stem=out.name, code=code) if code != 0 else None
    if error is not None:  # a rank's own message (the lowest rank's): said here, once
        raise error
    if code != 0 or not out.is_file():
        failed = RunFailed(f"the {nproc}-rank `weft {command}` failed (exit code {code}); its ranks' output above "
                           "says why", where=f"weft {command}")
        if code in (EXIT_USER, EXIT_GUARD):  # a rank's own message said what to fix: its exit code is the command's
            failed.exit_code = code
        raise failed


def launch_job(command: str, *, nproc: int, args: list[str]) -> dict:
    """Start ``nproc`` ranks of ``weft _<command>-worker ARGS --out FILE``; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / f"{command}.json"
        launch_ranks(command, nproc=nproc, args=args, out=out)
        return json.loads(out.read_text())


def run_on_rank(recipe: Recipe, *, out: pathlib.Path, job: Callable[..., dict | None], **options: Any) -> None:
    """One rank: ``job(recipe, rank=, world_size=, local_rank=, device_type=, **options)`` inside
    the process group; rank 0 writes its result to ``out`` as JSON (a job that returns None
    has written its own files)."""
    from weft.core.run.process_group import close_process_group, init_process_group

    rank, world_size, local_rank, device_type, _ = init_process_group(recipe)
    try:
        result = job(recipe, rank=rank, world_size=world_size, local_rank=local_rank, device_type=device_type,
                     **options)
    except WeftError as error:
        note(error, folder=out.parent, stem=out.name, rank=rank)  # for the launcher to say (core/run/rank_errors.py)
        close_process_group(clean=False)
        raise
    except BaseException:
        close_process_group(clean=False)
        raise
    if rank == 0 and result is not None:
        write_json_whole(out, result, indent=1)
    close_process_group(clean=True)
