"""A rank whose launcher is gone stops within a second, its ending recorded.

Ranks run in sessions of their own (torch's elastic launcher starts each with
``start_new_session``), so nothing the kernel does to the launcher's process group
reaches them: after SIGKILL of `weft run` (``kill -9``, the OOM killer, a scheduler that
signals one pid) they would train on as orphans, writing metrics and checkpoints into a
directory a new run may take. Two mechanisms, because each alone has a gap:

- The parent-death signal (``prctl(PR_SET_PDEATHSIG)``, Linux): the kernel sends SIGTERM
  when the thread that started this process exits. With `weft run`, torch's elastic agent
  runs in the launcher's own main thread (``elastic_launch`` calls the agent in-process,
  and it starts every rank, restarts included, from there), so that thread exits only
  with the launcher itself. It works where Python does not run: during imports, or in C
  code that holds the GIL. SIGTERM, not SIGKILL: if a torch version ever started ranks
  from a short-lived thread, the signal would only ask for a stop after the step (the
  preemption path, docs/faults.md), never kill a healthy run.
- A watch thread: every ``interval`` it compares ``os.getppid()`` with the parent it had
  (the launcher). A process whose parent died is re-parented at once (to init or a
  subreaper), so the change is certain and tied to the process, not to a thread; the check
  costs one system call. (A parent other than the launcher, an agent process between
  them, is watched with the launcher's pid and start time.) In training, while the main
  thread waits in a collective for a peer, only this thread can act: measured, SIGTERM
  alone leaves such a rank waiting. Once the training loop has attached its ending, the thread records it (summary
  "failed", a ``run.launcher_gone`` event) before it ends the process with exit code 1:
  the launcher that would have stopped the others is gone, so each rank ends itself.

Checkpoints already written stay (each is written whole before it is renamed into place):
`weft run --resume` continues from the newest.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from weft.core.errors import EXIT_RUNTIME, WeftError
from weft.core.run.lock import process_alive, process_start

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.recipe import Recipe
    from weft.core.run.end import Ending

#: linux/prctl.h
PR_SET_PDEATHSIG = 1


class LauncherGone(WeftError):
    """The process that started this rank has ended: a run-time failure, not a user error."""

    exit_code = EXIT_RUNTIME


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when this process's parent (thread) exits; False where there
    is no prctl (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    return True


class LauncherWatch:
    def __init__(self, *, launcher_pid: int, rank: int, interval: float = 0.2) -> None:
        self.launcher_pid, self.rank, self.interval = launcher_pid, rank, interval
        self.pdeathsig = False
        self._attached: tuple[Any, Any, Any] | None = None
        self._parent, self._start = launcher_pid, None

    def start(self) -> LauncherWatch:
        """Signal and thread on; a launcher already gone (it died between starting this process
        and this call, when no parent-death signal was set yet) is LauncherGone at once."""
        self.pdeathsig = set_parent_death_signal()
        self.resolve()
        # A daemon: it never holds the process up, and it watches until the process ends.
        threading.Thread(target=self._run, name="weft-launcher-watch", daemon=True).start()
        return self

    def resolve(self) -> None:
        """Whom to watch. The parent is the launcher (torch's agent runs inside it); were it
        another process between them (an agent of its own), the parent is watched and the
        launcher's pid too. A parent that is not the launcher while the launcher is gone means
        this process was already re-parented: LauncherGone."""
        self._parent = os.getppid()
        self._start = process_start(self.launcher_pid)
        if self._parent != self.launcher_pid and not process_alive(self.launcher_pid, self._start):
            raise LauncherGone(self._message())

    def gone(self) -> bool:
        if os.getppid() != self._parent:
            return True
        return self._parent != self.launcher_pid and not process_alive(self.launcher_pid, self._start)

    def attach(self, *, recipe: Recipe, ctx: RunContext, ending: Ending) -> None:
        """From now on, the run's ending is recorded (summary.json on rank 0, the log) before
        the process ends."""
        self._attached = (recipe, ctx, ending)

    def _message(self) -> str:
        resume = "; continue the run from its newest checkpoint with weft run --resume" if self._attached else ""
        return f"rank {self.rank}: its launcher (pid {self.launcher_pid}) is gone, so this rank stops{resume}"

    def _run(self) -> None:
        while not self.gone():
            time.sleep(self.interval)
        self._end()

    def _end(self) -> None:
        error = LauncherGone(self._message())
        try:
            if self._attached is not None:
                recipe, ctx, ending = self._attached
                ctx.log.error("run.launcher_gone", launcher_pid=self.launcher_pid, rank=self.rank,
                              parent=os.getppid(), parent_death_signal=self.pdeathsig)
                ending.record(recipe, ctx, error=error)
        finally:
            with contextlib.suppress(Exception):  # stderr may be a pipe nobody reads any more
                print(f"weft: error: {error}", file=sys.stderr, flush=True)
            os._exit(EXIT_RUNTIME)
