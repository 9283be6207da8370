"""Commands that run a recipe on N local ranks and report rank 0's result (`weft eval`,
`weft generate`): the parent starts the ranks of a hidden worker command and reads the
JSON rank 0 writes; each rank runs one function inside its process group."""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Any, Callable

from weft.core.errors import RunFailed
from weft.core.recipe import Recipe


def launch_job(command: str, *, nproc: int, args: list[str]) -> dict:
    """Start ``nproc`` ranks of ``weft _<command>-worker ARGS --out FILE``; rank 0's result."""
    from weft.core.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / f"{command}.json"
        code = launch_local(nproc=nproc, args=["-m", "weft", f"_{command}-worker", *args, "--out", str(out)])
        if code != 0 or not out.is_file():
            raise RunFailed(f"the {nproc}-rank `weft {command}` failed (exit code {code}); its ranks' output above "
                            "says why", where=f"weft {command}")
        return json.loads(out.read_text())


def run_on_rank(recipe: Recipe, *, out: pathlib.Path, job: Callable[..., dict], **options: Any) -> None:
    """One rank: ``job(recipe, rank=, world_size=, local_rank=, device_type=, **options)`` inside
    the process group; rank 0 writes its result to ``out``."""
    from weft.core.prepare import close_process_group, init_process_group

    rank, world_size, local_rank, device_type, _ = init_process_group(recipe)
    try:
        result = job(recipe, rank=rank, world_size=world_size, local_rank=local_rank, device_type=device_type,
                     **options)
    except BaseException:
        close_process_group(clean=False)
        raise
    if rank == 0:
        out.write_text(json.dumps(result, indent=1))
    close_process_group(clean=True)
