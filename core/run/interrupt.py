"""Preemption: SIGTERM or SIGINT asks the run to stop after the current step, saved.

The first signal sets a flag the loop reads between steps; the ranks agree on it (one
all-reduce), so they all stop after the same step, write a checkpoint and the summary,
and exit 0. A second signal, later than ``grace_s`` after the first, stops at once (the
default action of that signal). Signals closer together count as one: Ctrl-C reaches
every process of the terminal's group, and torch's launcher then forwards a SIGTERM of
its own.
"""

from __future__ import annotations

import signal
import time

import torch

from weft.core.run.collectives import any_rank

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self, *, grace_s: float = 2.0) -> None:
        self.signal: str | None = None
        self._at = 0.0
        self._grace_s = grace_s
        self._previous: dict = {}

    def install(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._at = signal.Signals(signum).name, now
            return
        if now - self._at > self._grace_s:  # a second, deliberate signal: stop now
            self.restore()
            signal.raise_signal(signum)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank was signalled (collective: call on all ranks)."""
        return any_rank(self.signal is not None, device=device)
