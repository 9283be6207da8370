"""A peer that stops responding ends the run with one line naming it, never a silent hang.

Each rank runs one daemon thread. Every ``interval`` it bumps a heartbeat counter in the
run's rendezvous store and reads the others'; a rank whose counter has not moved for
``STALE_BEATS`` intervals (as this rank's clock sees it: no clock is compared across
hosts) has stopped: frozen, dead, or wedged where no Python thread runs. When this rank's
current step has lasted longer than ``parallel.timeout_s``, the thread ends the process:
the lowest rank still beating prints which ranks stopped (or, when every rank beats, that
one waits for a collective the others never joined), the ending is recorded, and the
launcher stops the rest. Collectives' own timeouts are not relied on: torch's default
groups wait 30 minutes, and NCCL's watchdog aborts without naming the peer.

When a collective raises in the main thread instead (a peer's connection closed), the
loop asks ``stopped_peers`` and names them the same way.

The rank that names stopped peers also ends those on its own host (each rank leaves its host
and pid in the store): a frozen process heeds no SIGTERM, and torch's agent waits 30 s after
sending one before it kills.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

from weft.core.errors import EXIT_RUNTIME, GuardAbort, WeftError

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.recipe import Recipe
    from weft.core.run.end import Ending

#: Intervals without a heartbeat after which a peer counts as stopped.
STALE_BEATS = 4


def interval_for(timeout_s: float, world: int) -> float:
    """Heartbeat period: a tenth of the timeout, between 0.2 s and 1 s (a stopped peer is
    named within seconds of a collective failing), longer beyond 16 ranks: every rank reads
    every other's counter each period, world^2 store reads in all."""
    return min(1.0, max(0.2, timeout_s / 10)) * max(1.0, world / 16)


class PeerWatch:
    """``on_stuck(step, stopped_ranks, waited_s, reporter)`` runs on the watch thread when
    a step outlasts ``timeout_s``; it is expected to end the process. ``reporter``: this
    rank is the lowest one still beating, the one to say it."""

    def __init__(self, *, store: Any, rank: int, world: int, timeout_s: float,
                 on_stuck: Callable[[int, list[int], float, bool], None]) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.on_stuck = on_stuck
        self.interval = interval_for(timeout_s, world)
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (last counter, when it changed)
        self._step: tuple[int, float] | None = None  # (step, when it started)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> PeerWatch:
        if self.world > 1 and self._thread is None:
            with contextlib.suppress(Exception):  # no store: nothing to end a frozen peer by, the agent still does
                self.store.set(f"weft/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
            now = time.monotonic()
            self._seen = {r: (None, now) for r in range(self.world) if r != self.rank}
            self._thread = threading.Thread(target=self._run, name="weft-peer-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def step_started(self, step: int) -> None:
        self._step = (step, time.monotonic())

    def step_finished(self) -> None:
        self._step = None

    def stopped_peers(self, *, wait: bool = True) -> list[int]:
        """Ranks whose heartbeat has stood still for STALE_BEATS intervals. ``wait``: first
        give a peer that just stopped the time to count as stopped."""
        if self._thread is None:
            return []
        if wait:
            self._stop.wait(STALE_BEATS * self.interval + self.interval)
        with self._lock:
            now = time.monotonic()
            return sorted(r for r, (_, changed) in self._seen.items() if now - changed > STALE_BEATS * self.interval)

    def end_stopped(self, ranks: list[int]) -> list[int]:
        """SIGKILL the stopped ``ranks`` that run on this host; returns those ended."""
        ended = []
        for r in ranks:
            with contextlib.suppress(Exception):  # its key absent, the store gone, the process gone
                host, pid = self.store.get(f"weft/pid/{r}").decode().split()
                if host == socket.gethostname() and int(pid) != os.getpid():
                    os.kill(int(pid), signal.SIGKILL)
                    ended.append(r)
        return ended

    def _run(self) -> None:
        beats = 0
        while not self._stop.wait(self.interval):
            beats += 1
            try:
                self.store.set(f"weft/alive/{self.rank}", str(beats))
                self._read_peers()
            except Exception:  # the store's host (rank 0's agent) is gone: the launcher ends the run
                pass
            step = self._step
            if step is not None and time.monotonic() - step[1] > self.timeout_s:
                stopped = self.stopped_peers(wait=False)
                reporter = self.rank == min(set(range(self.world)) - set(stopped))
                self.on_stuck(step[0], stopped, time.monotonic() - step[1], reporter)
                return

    def _read_peers(self) -> None:
        keys = {r: f"weft/alive/{r}" for r in self._seen}
        present = [r for r in keys if self.store.check([keys[r]])]
        values = {r: self.store.get(keys[r]) for r in present}
        now = time.monotonic()
        with self._lock:
            for r, value in values.items():
                if value != self._seen[r][0]:
                    self._seen[r] = (value, now)


class PeerLost(WeftError):
    """Ranks stopped responding: a run-time failure, not a user error."""

    exit_code = EXIT_RUNTIME


def watch_peers(*, store: Any, recipe: Recipe, ctx: RunContext, ending: Ending) -> PeerWatch:
    """The run's watch (idle on one rank). When a step outlasts ``parallel.timeout_s``: the
    lowest rank still beating says which ranks stopped, the ending is recorded
    (summary.json on rank 0, one log event), and the process ends with exit code 1; the
    launcher stops the other ranks."""
    timeout = recipe.parallel.timeout_s

    def stuck(step: int, stopped: list[int], waited: float, reporter: bool) -> None:
        if stopped:
            what = f"rank(s) {', '.join(map(str, stopped))} stopped responding (no heartbeat for the last " \
                   f"{STALE_BEATS * interval_for(timeout, ctx.world_size):.0f} s)"
        else:
            what = ("every rank is alive, so some wait in a collective the others never joined (a hook or "
                    "strategy that runs collectives on some ranks only?)")
        error = PeerLost(f"step {step} on rank {ctx.rank} has not finished after {waited:.0f} s"
                         f"{_main_thread_waits_in()}: {what}", where="parallel.timeout_s")
        try:
            ctx.log.error("run.peer_timeout", step=step, stopped=stopped, waited_s=round(waited, 1))
            ending.record(recipe, ctx, error=error)
        finally:
            if reporter:
                print(f"weft: error: {error}", file=sys.stderr, flush=True)
                ended = watch.end_stopped(stopped)  # frozen: no SIGTERM of the agent's would reach them
                if ended:
                    ctx.log.info("run.peers_ended", ranks=ended, signal="SIGKILL")
            else:
                time.sleep(1.0)  # the reporter's line first
            os._exit(EXIT_RUNTIME)

    watch = PeerWatch(store=store, rank=ctx.rank, world=ctx.world_size, timeout_s=timeout, on_stuck=stuck)
    return watch.start()


def peers_lost(error: BaseException, watch: PeerWatch, *, ctx: RunContext) -> PeerLost | None:
    """For an error out of the step: when peers have stopped beating (the error is then most
    likely their broken connection or a collective's timeout), one that names them."""
    if watch.world == 1 or not _collective_failure(error):
        return None
    stopped = watch.stopped_peers(wait=False) or watch.stopped_peers(wait=True)
    if not stopped:
        return None
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return PeerLost(f"rank(s) {', '.join(map(str, stopped))} stopped responding; on rank {ctx.rank} this "
                    f"surfaced as {type(error).__name__}: {first}", where="parallel")


#: Words in the messages of Gloo's and NCCL's failures when a peer is gone.
_PEER_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "broken pipe", "socket")


def _collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, (WeftError, GuardAbort)):
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(w in str(error).lower() for w in _PEER_WORDS)


#: weft's own code (frames under these folders).
_WEFT_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
                   for d in ("core", "strategies", "plugins"))


def _main_thread_waits_in() -> str:
    """Where this rank's main thread is: its innermost frame (the collective it waits in,
    say) and the innermost frame of weft's own code above it; "" when unknown."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)  # outermost first
    inner = stack[-1]
    ours = next((f for f in reversed(stack) if f.filename.startswith(_WEFT_DIRS) and f is not inner), None)

    def at(f: traceback.FrameSummary) -> str:
        return f"{f.name} ({'/'.join(f.filename.split(os.sep)[-2:])}:{f.lineno})"

    return f" (it waits in {at(inner)}" + (f", called from {at(ours)}" if ours else "") + ")"
