"""Watch the position ids the text decoder receives against the context its rotary
embedding holds, and say once, with the YaRN factor the data needs, when a batch
goes past it.

A forward pre-hook on the text decoder, put first so that under sequence
parallelism it sees the whole sequence's ids (the split hook cuts them after it).
It reads what the model computed, so mRoPE's compressed image positions and
packing's per-document restarts count as the rotary embedding sees them.
"""

from __future__ import annotations

from typing import Any

import torch

from weft.strategies.model.yarn import needed_factor


class PositionWatch:
    """``largest``: the largest position id seen so far (-1 before the first forward).

    The hook only folds each batch's maximum into a tensor on the batch's device (no
    host sync inside the step); ``largest`` reads it, and the loop calls ``poll()``
    once per step, after the step's own syncs, to warn."""

    def __init__(self, *, decoder: torch.nn.Module, context: int, original: int, scaling: str, log: Any) -> None:
        self.context, self.original, self.scaling, self.log = context, original, scaling, log
        self._before = -1  # the run's largest before a resume, from its checkpoint
        self._counted = -1  # from token counts (decoders that number tokens themselves)
        self._seen: torch.Tensor | None = None  # () running max of position ids, on their device
        self.warned = False
        self.handle = decoder.register_forward_pre_hook(self._see, with_kwargs=True, prepend=True)

    @property
    def largest(self) -> int:
        return max(self._before, self._counted, int(self._seen.item()) if self._seen is not None else -1)

    def resumed(self, largest: int) -> None:
        self._before = max(self._before, largest)

    def remove(self) -> None:
        self.handle.remove()

    def poll(self) -> None:
        """Warn, once per run, when a batch so far went past the rotary context."""
        largest = self.largest
        if largest >= self.context and not self.warned:
            self.warned = True
            factor = needed_factor(largest, trained=self.original)
            self.log.warning(
                "positions.beyond_trained",
                largest_position=largest,
                context=self.context,
                rope_scaling=self.scaling,
                needed_factor=factor,
                hint=f"set model.rope_scaling = 'yarn' and model.rope_factor = {factor:g} "
                     f"(over {self.original} trained positions)",
            )

    def _see(self, module, args, kwargs) -> None:
        positions = kwargs.get("position_ids")
        if positions is not None:
            if positions.ndim == 3 and positions.shape[0] == 4:
                positions = positions[1:]  # row 0: text positions for masks; rows 1-3 feed the rotary embedding
            batch_max = positions.detach().max()
            self._seen = batch_max if self._seen is None else torch.maximum(self._seen, batch_max)
            return None
        tokens = kwargs.get("inputs_embeds") if kwargs.get("inputs_embeds") is not None else kwargs.get("input_ids")
        if tokens is not None:  # the decoder numbers the tokens itself: 0..S-1
            self._counted = max(self._counted, tokens.shape[1] - 1)
        return None
