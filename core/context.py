"""What every hook call can see of the run, besides the Plan: device, ranks, recipe, log."""

from __future__ import annotations

import pathlib
from typing import Any

import attrs


@attrs.define(kw_only=True)
class RunContext:
    """Per-run state handed to hooks. Only ``counters`` is written by plugins."""

    recipe: Any
    device: Any  # torch.device
    rank: int = 0
    world_size: int = 1
    run_dir: pathlib.Path | None = None
    log: Any = None  # a structlog logger bound with rank
    counters: dict[str, int] = attrs.field(factory=dict)
    start_step: int = 0  # first step to yield: > 0 when resuming
    positions: Any = None  # the model's PositionWatch: largest position id seen, vs its rotary context

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n
