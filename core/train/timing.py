"""Where a step's time goes (forward, backward, optimizer), without a host sync in the step.

On CUDA each phase is bracketed by CUDA events, which the GPU timestamps as it reaches
them; they are read once the step has synced anyway (its loss). On the CPU the clock is
the host's. The sums go into the metrics row as ``forward_s``, ``backward_s``,
``optimizer_s``. Each phase is also a profiler range on the host (``weft.forward``, ...: a
no-op unless torch.profiler runs), so a profiled step's kernels can be told apart by phase
(benchmarks/step/profile_step.py).
"""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object]] = []
        self._open: dict[str, object] = {}
        self._ranges: dict[str, torch.autograd.profiler.record_function] = {}

    def _mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, phase: str) -> None:
        if phase in self._ranges:  # left open by a phase that raised (a retried step): closed here
            self._ranges.pop(phase).__exit__(None, None, None)
        self._ranges[phase] = torch.autograd.profiler.record_function(f"weft.{phase}")
        self._ranges[phase].__enter__()
        self._open[phase] = self._mark()

    def stop(self, phase: str) -> None:
        self._spans.append((phase, self._open.pop(phase), self._mark()))
        self._ranges.pop(phase).__exit__(None, None, None)

    def seconds(self) -> dict[str, float]:
        """Seconds per phase since the last call; waits for the GPU to reach the last mark."""
        totals: dict[str, float] = {}
        for phase, begin, end in self._spans:
            if self.cuda:
                end.synchronize()
                took = begin.elapsed_time(end) / 1000.0  # ms -> s
            else:
                took = end - begin
            totals[f"{phase}_s"] = totals.get(f"{phase}_s", 0.0) + took
        self._spans.clear()
        return totals
