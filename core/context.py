"""What every hook call can see of the run besides the Plan, and what guards see of a step."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from weft.core.models import ModelAdapter, PositionWatch
    from weft.core.recipe import Recipe


@attrs.define(kw_only=True)
class RunContext:
    """Per-run state handed to hooks. Only ``counters`` is written by plugins."""

    recipe: Recipe
    device: torch.device
    rank: int = 0
    world_size: int = 1
    run_dir: pathlib.Path | None = None
    log: Any = None  # a structlog logger bound with rank
    counters: dict[str, int] = attrs.field(factory=dict)
    start_step: int = 0  # first step to yield: > 0 when resuming
    one_pass: bool = False  # weft eval: batching yields every sample once, then its iterator ends
    #: weft eval/generate: no backward runs. The shard hook then attaches no recomputation or
    #: activation offload (they serve a backward only, and their hooks break a compiled step).
    inference: bool = False
    plugin_state: dict = attrs.field(factory=dict)  # what a plugin keeps between calls in this run, by its own keys
    adapter: ModelAdapter | None = None  # the model family's adapter (weft_models)
    positions: PositionWatch | None = None  # largest position id seen, vs the rotary context
    optimizer: Any = None  # the run's optimizer (weft_optimizer), once made; guards may read its state
    adapter_dir: pathlib.Path | None = None  # weft eval/generate --adapter: a saved adapter the adapter hook loads

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


@attrs.define(kw_only=True)
class StepState:
    """What guards see at the end of a step: global values, already reduced."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    tokens: int = 0
    consecutive_skips: int = 0
    error: BaseException | None = None
    #: This rank's micro-batch sizes in tokens (batch x length), set before the forward.
    local_tokens: tuple[int, ...] = ()
    # Per-run state a guard keeps between steps (a running mean, a counter), keyed
    # by the guard's strategy name; in a run it is ``ctx.plugin_state``, the one per-run
    # dict every plugin (guards, metrics sinks) keeps its state in.
    memory: dict[str, Any] = attrs.field(factory=dict)

    def begin(self, step: int) -> None:
        """The next step: its own values cleared; the run's (skips in a row, memory) kept."""
        self.step, self.loss, self.grad_norm, self.tokens, self.error, self.local_tokens = step, None, None, 0, None, ()
