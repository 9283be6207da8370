"""Checkpointed units' inputs kept in host memory between forward and backward.

With full activation checkpointing a unit keeps only its input (the residual stream,
tokens x hidden: 3.5 GiB per layer of a 7B model at 512K tokens) until backward
recomputes the unit from it. Here that input goes to host memory once the unit's forward
is done and comes back when backward reaches the unit, so GPU memory holds only the few
units in flight. The tensor keeps its identity (the checkpoint still refers to it): only
its storage is emptied and refilled, as FSDP2 does with parameters, and a storage copy
bumps no version counter. On CUDA the copies run on a side stream: device-to-host after
the unit's forward, host-to-device for unit i-1 while unit i runs its backward. Host
buffers are pinned and reused from step to step. Elsewhere (CPU tests) the same moves are
plain copies, so the arithmetic is proven identical to the unmoved run.

``keep_every`` N > 1 halves (thirds, ...) the host memory: only every Nth unit's input goes to
the host; a unit in between empties its input's storage and, when backward reaches it,
regenerates it by running the unit before once more, without gradients, from that unit's own
input (brought back, or itself regenerated first), as that unit's forward made it the first
time: the same kernels on the same values, so the same bits. One more forward of N - 1 units
in N, for 1/N of the host memory. A unit whose input is not the output of the unit before (the
first layer, anything between) keeps its input on the host as usual.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch


class ActivationOffload:
    """Attach to the units whose rule asks for it (in forward order); one per run."""

    def __init__(self, *, device: torch.device, keep_every: int = 1) -> None:
        if keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {keep_every}")
        self.keep_every = keep_every
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.buffers: dict[int, torch.Tensor] = {}  # unit index -> host buffer, reused across steps
        self.parked: dict[int, torch.Tensor] = {}  # unit index -> the input whose storage is on the host
        self.ready: dict[int, Any] = {}  # unit index -> event: its storage is back on the device
        # unit index -> its input, between the unit's pre- and post-forward hooks. Weak: the
        # checkpoint's recomputation in backward runs the pre-hook but stops early, before the
        # post-hook (torch's early stop), and a strong reference would keep every restored
        # input on the device until the next step (one hidden-sized tensor per layer: 24 GiB
        # at 128K for a 7B model, measured on the GPU).
        self._pending: dict[int, weakref.ref] = {}
        self.moved_bytes = 0
        # Regeneration (keep_every > 1): unit index -> its emptied input and that input's bytes;
        # unit index -> (unit, args, kwargs) of its forward, for the unit after it to run again;
        # the last unit's output (weak), which the next unit's input must be to be regenerated.
        self.emptied: dict[int, tuple[torch.Tensor, int]] = {}
        self.calls: dict[int, tuple[Any, tuple, dict]] = {}
        self._last_out: tuple[int, weakref.ref] | None = None
        self.regenerated = 0

    def attach(self, units: list[torch.nn.Module]) -> int:
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(functools.partial(self._before, index), with_kwargs=True)
            unit.register_forward_hook(functools.partial(self._after, index))
        return len(units)

    # -- forward -----------------------------------------------------------------------

    def _before(self, index: int, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return
        if index == 0:  # a new forward: what the last one stored for units that had none after them goes
            self.calls.clear()
        if self.keep_every > 1 and (index + 1) % self.keep_every:  # the next unit may regenerate from this
            self.calls[index] = (module, args, kwargs)
        x = args[0] if args else kwargs.get("hidden_states")
        if _sole_owner(x):
            self._pending[index] = weakref.ref(x)

    def _after(self, index: int, module, args, output) -> None:
        pending = self._pending.pop(index, None)
        x = pending() if pending is not None else None
        out = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        before, self._last_out = self._last_out, (index, weakref.ref(out))
        if x is None:
            return
        if index % self.keep_every and index - 1 in self.calls and before is not None \
                and before[0] == index - 1 and before[1]() is x:
            # x is the unit before's output: emptied now, made again from that unit in backward.
            self.emptied[index] = (x, x.untyped_storage().nbytes())
            x.untyped_storage().resize_(0)
            out.register_hook(functools.partial(self._on_backward, index))
            return
        self.calls.pop(index - 1, None)  # not needed: this unit keeps its own input
        host = self._buffer(index, x)
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream())  # x is written
            with torch.cuda.stream(self.side):
                host.untyped_storage().copy_(x.untyped_storage(), non_blocking=True)
            x.record_stream(self.side)  # the freed block is not reused before the copy is done
        else:
            host.untyped_storage().copy_(x.untyped_storage())
        x.untyped_storage().resize_(0)
        self.parked[index] = x
        self.moved_bytes += host.untyped_storage().nbytes()
        # The output's gradient arrives just before backward recomputes this unit from x.
        out.register_hook(functools.partial(self._on_backward, index))

    # -- backward ----------------------------------------------------------------------

    def _on_backward(self, index: int, grad: torch.Tensor) -> None:
        self._ensure(index)
        if index - 1 in self.parked:
            self._bring_back(index - 1)  # prefetch: the unit before runs next in backward

    def _ensure(self, index: int) -> None:
        """Unit ``index``'s input on the device, the compute stream waiting for it: brought back
        from the host, or regenerated from the unit before (whose input is ensured first)."""
        if index in self.emptied:
            self._ensure(index - 1)
            self._regenerate(index)
            return
        self._bring_back(index)  # nothing to do if a prefetch brought it already
        event = self.ready.pop(index, None)
        if self.cuda and event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _regenerate(self, index: int) -> None:
        x, nbytes = self.emptied.pop(index)
        module, args, kwargs = self.calls.pop(index - 1)
        with torch.no_grad():
            output = module(*args, **kwargs)
        out = output[0] if isinstance(output, (tuple, list)) else output
        if out.shape != x.shape or out.dtype != x.dtype:
            raise RuntimeError(f"unit {index - 1} ran again gave {tuple(out.shape)} {out.dtype}, not the input of "
                               f"unit {index} ({tuple(x.shape)} {x.dtype})")
        out = out.contiguous()
        if out.untyped_storage().nbytes() != nbytes:  # a view of a larger block
            out = out.clone()
        storage = x.untyped_storage()
        storage.resize_(nbytes)
        storage.copy_(out.untyped_storage())  # a storage copy: no version bump
        self.regenerated += 1

    def _bring_back(self, index: int) -> None:
        x = self.parked.pop(index, None)
        if x is None:
            return
        host = self.buffers[index]
        storage = x.untyped_storage()
        storage.resize_(host.untyped_storage().nbytes())
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream())  # the new block is free on the compute stream
            with torch.cuda.stream(self.side):
                storage.copy_(host.untyped_storage(), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            x.record_stream(self.side)
            self.ready[index] = event
        else:
            storage.copy_(host.untyped_storage())

    def _buffer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        held = self.buffers.get(index)
        if held is None or held.shape != x.shape or held.dtype != x.dtype:
            held = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.cuda)
            self.buffers[index] = held
        return held


def _sole_owner(x: Any) -> bool:
    """A plain tensor that is the only user of its whole storage: emptying it breaks nothing else."""
    return (isinstance(x, torch.Tensor) and x._base is None and x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() == x.numel() * x.element_size() and x.numel() > 0)
