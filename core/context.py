"""What every hook call can see of the run besides the Plan (frozen), the core's own state of the
run beside it, and what guards see of a step."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from weft.core.models import ModelFamily, PositionWatch
    from weft.core.recipe import Recipe


@attrs.define(kw_only=True)
class RunState:
    """What the core learns of a run as it goes, after the context is made: plugins read it
    through ``RunContext``'s properties, only the core writes it. One object shared by every
    context of a run (a context made anew from another keeps it), so whatever holds an
    earlier context (the peer watch, the ending's record) sees the same values."""

    start_step: int = 0  # first step to yield: > 0 when resuming
    optimizer: Any = None  # the run's optimizer (weft_optimizer), once made; guards may read its state
    positions: PositionWatch | None = None  # largest position id seen, vs the rotary context


@attrs.frozen(kw_only=True)
class RunContext:
    """Per-run facts handed to hooks, frozen: a hook that assigns to one fails
    (``attrs.exceptions.FrozenInstanceError``; ``AttributeError`` for the properties). What a
    plugin keeps is in the two dicts it may write: ``counters`` (through ``count``: summed into
    the run's summary) and ``plugin_state`` (by its own keys). Where the core settles a fact
    later (the recipe resolved by a rope rule or by ``train.epochs``), it makes a new context
    with ``attrs.evolve`` and hands that one on."""

    recipe: Recipe
    device: torch.device
    rank: int = 0
    world_size: int = 1
    run_dir: pathlib.Path | None = None
    log: Any = None  # a structlog logger bound with rank
    counters: dict[str, int] = attrs.field(factory=dict)
    one_pass: bool = False  # weft eval: batching yields every sample once, then its iterator ends
    #: weft eval/generate: no backward runs. The shard hook then attaches no recomputation or
    #: activation offload (they serve a backward only, and their hooks break a compiled step).
    inference: bool = False
    plugin_state: dict = attrs.field(factory=dict)  # what a plugin keeps between calls in this run, by its own keys
    family: ModelFamily | None = None  # the model family (weft_models)
    adapter_dir: pathlib.Path | None = None  # weft eval/generate --adapter: a saved adapter the adapter hook loads
    state: RunState = attrs.field(factory=RunState)  # the core's: read it through the properties below

    @property
    def start_step(self) -> int:
        return self.state.start_step

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer

    @property
    def positions(self) -> PositionWatch | None:
        return self.state.positions

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
    #: The objective's values beside the loss (``Objective.step_stats``), each a mean over its units.
    stats: dict[str, float] = attrs.field(factory=dict)
    # Per-run state a guard keeps between steps (a running mean, a counter), keyed
    # by the guard's strategy name; in a run it is ``ctx.plugin_state``, the one per-run
    # dict every plugin (guards, metrics sinks) keeps its state in.
    memory: dict[str, Any] = attrs.field(factory=dict)

    def begin(self, step: int) -> None:
        """The next step: its own values cleared; the run's (skips in a row, memory) kept."""
        self.step, self.loss, self.grad_norm, self.tokens, self.error, self.local_tokens = step, None, None, 0, None, ()
        self.stats = {}
