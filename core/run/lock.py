"""One run per run directory: ``run.lock`` holds the running run's host, pid, start time and ranks.

Taken before any rank starts (by the process that launches them, or by rank 0 under an
external launcher) and removed when the run ends, however it ends. Each rank weft's own
launcher starts adds itself (rank, pid, the process's start time) as its first act, so the
lock knows every process that may still write into the directory: the launcher can be
gone (SIGKILL, the OOM killer) while its ranks still stop. A second run into the same
directory is a user error naming the live processes; a lock whose processes all no longer
run on this host is taken over with a warning (a crash or SIGKILL leaves one).

Every read-modify-write of the lock happens under an exclusive ``flock`` of the run
directory, and the file is replaced whole (``os.replace``): a run that reads it never sees
half a file, and a rank that joins cannot race a run taking the directory over.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import socket
import sys
from typing import Iterator

from weft.core.errors import WeftError
from weft.core.whole_files import write_json_whole

LOCK = "run.lock"


@contextlib.contextmanager
def run_lock(run_dir: pathlib.Path) -> Iterator[None]:
    path = run_dir / LOCK
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid()),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "ranks": {}}
    run_dir.mkdir(parents=True, exist_ok=True)
    with _guarded(run_dir):
        _take(path, mine)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError), _guarded(run_dir):
            if _holder(path).get("pid") == mine["pid"]:
                path.unlink()
        with contextlib.suppress(OSError):
            run_dir.rmdir()  # only when empty: a run stopped by a user error leaves no folder behind


class LockLost(WeftError):
    """A rank found the directory's lock held by another run than its launcher's."""


def join_run(run_dir: pathlib.Path, *, launcher_pid: int, rank: int) -> None:
    """Add this process to the lock its launcher holds, as rank ``rank``. A lock that is no
    longer the launcher's (taken over because the launcher was gone before this rank
    joined) is an error: this rank must not write into another run's directory."""
    path = run_dir / LOCK
    with _guarded(run_dir):
        holder = _holder(path)
        if holder.get("pid") != launcher_pid or holder.get("host") != socket.gethostname():
            raise LockLost(f"{path} is not held by this rank's launcher (pid {launcher_pid}) but by "
                           f"{_describe(holder)}: this rank stops", where=str(run_dir))
        ranks = dict(holder.get("ranks") or {})
        ranks[str(rank)] = {"pid": os.getpid(), "start": process_start(os.getpid())}
        _write(path, {**holder, "ranks": ranks})


def live_processes(holder: dict) -> dict[str, int]:
    """The lock's processes still running on this host: ``{"weft run" | "rank N": pid}``."""
    if holder.get("host") != socket.gethostname():
        return {}
    found = {"weft run": (holder.get("pid"), holder.get("start"))}
    for rank, entry in sorted((holder.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        found[f"rank {rank}"] = (entry.get("pid"), entry.get("start"))
    return {who: pid for who, (pid, start) in found.items() if process_alive(pid, start)}


def _take(path: pathlib.Path, mine: dict) -> None:
    if not path.exists():
        _write(path, mine)
        return
    holder = _holder(path)
    other_host = holder and holder.get("host") != mine["host"]
    live = {} if other_host else live_processes(holder)
    if not other_host and not live:
        print(f"weft: taking over the lock of a run that is gone ({_describe(holder)}): {path}", file=sys.stderr)
        _write(path, mine)
        return
    if other_host:
        what = f"{_describe(holder)}; its processes cannot be checked from {mine['host']}"
    else:
        what = (f"{', '.join(f'{who} (pid {pid})' for who, pid in live.items())} of the run started "
                f"{holder.get('started', '?')} still running on {mine['host']}")
        if "weft run" not in live:
            what += f" after its weft run (pid {holder.get('pid')}) ended"
    raise WeftError(f"another run is using this run directory: {what}. Give this run its own --run-dir; if "
                    f"that run is gone, delete {path}", where=str(path.parent))


def _describe(holder: dict) -> str:
    if not holder:
        return "an unreadable lock"
    ranks = holder.get("ranks") or {}
    pids = f", ranks' pids {', '.join(str(e.get('pid')) for e in ranks.values())}" if ranks else ""
    return f"pid {holder.get('pid')}{pids} on {holder.get('host')}, started {holder.get('started', '?')}"


@contextlib.contextmanager
def _guarded(run_dir: pathlib.Path) -> Iterator[None]:
    """An exclusive flock of the directory itself: no extra file to clean up, and the kernel
    drops it when its holder dies, so a killed process never leaves it held."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            # NFS emulates flock with byte-range locks, which a read-only (directory) descriptor
            # cannot take: there the lock is as before, without the serialisation.
            pass
        yield
    finally:
        os.close(fd)


def _write(path: pathlib.Path, content: dict) -> None:
    write_json_whole(path, content)


def _holder(path: pathlib.Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # unreadable: written by an older weft killed mid-write, treated as gone on this host
    return found if isinstance(found, dict) else {}


def process_start(pid: int) -> int | None:
    """The process's start (clock ticks since boot, /proc/PID/stat field 22): with the pid, it
    names one process, so a pid reused since by another is not mistaken for the run's."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # fields after the command name, which may hold spaces


def _state(pid: int) -> str | None:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def process_alive(pid, start=None) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    if _state(pid) in ("Z", "X"):
        return False  # exited, not yet reaped by its (new) parent: it writes nothing any more
    found = process_start(pid)
    return start is None or found is None or found == start
