"""Loss (or gradient-norm) spikes: a step far above the recent median.

The median of the last ``window`` accepted steps is the reference: unlike a running mean
it is not dragged up by the spike it should catch, nor by the one before. A step is a
spike when its value exceeds ``ratio`` times that median, once ``warmup`` steps have been
seen. Spiked steps are not added to the window (a skipped step changed nothing), so a
run of spikes is judged against the same calm reference.
"""

from __future__ import annotations

import statistics
from collections import deque

import attrs


@attrs.define
class SpikeWindow:
    window: int
    ratio: float
    warmup: int
    values: deque = attrs.field(init=False)
    consecutive: int = 0

    def __attrs_post_init__(self) -> None:
        self.values = deque(maxlen=self.window)

    def judge(self, value: float) -> float | None:
        """The reference median when ``value`` is a spike (it is then not kept), else None (kept)."""
        if len(self.values) >= self.warmup:
            median = statistics.median(self.values)
            if median > 0 and value > self.ratio * median:
                self.consecutive += 1
                return median
        self.values.append(value)
        self.consecutive = 0
        return None
