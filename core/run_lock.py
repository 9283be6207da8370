"""One run per run directory: ``run.lock`` holds the running run's host, pid and start time.

Taken before any rank starts (by the process that launches them, or by rank 0 under an
external launcher) and removed when the run ends, however it ends. A second run into the
same directory is a user error naming the holder; a lock left by a process that no
longer runs on this host is taken over with a warning (a crash or SIGKILL leaves one).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import socket
import sys
from typing import Iterator

from weft.core.errors import WeftError

LOCK = "run.lock"


@contextlib.contextmanager
def run_lock(run_dir: pathlib.Path) -> Iterator[None]:
    path = run_dir / LOCK
    mine = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().isoformat(timespec="seconds")}
    _take(path, mine)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == mine["pid"]:
                path.unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when empty: a run stopped by a user error leaves no folder behind


def _take(path: pathlib.Path, mine: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # atomic: one of two racing runs wins
    except FileExistsError:
        holder = _holder(path)
        if not holder or (holder.get("host") == mine["host"] and not _alive(holder.get("pid"))):
            print(f"weft: taking over the lock of a run that is gone (pid {holder.get('pid')}, started "
                  f"{holder.get('started', '?')}): {path}", file=sys.stderr)
            tmp = path.with_name(f".{LOCK}.{mine['pid']}")
            tmp.write_text(json.dumps(mine))
            os.replace(tmp, path)
            return
        raise WeftError(
            f"another run is using this run directory: pid {holder.get('pid')} on {holder.get('host')}, started "
            f"{holder.get('started', '?')}. Give this run its own --run-dir; if that run is gone, delete {path}",
            where=str(path.parent)) from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(mine))


def _holder(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable: written by a process killed mid-write, treated as gone on this host


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
