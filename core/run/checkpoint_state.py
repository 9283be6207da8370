"""What a checkpoint's small state is made of (the RNG as tensors, the scheduler as JSON), how
many bytes its tensors are, and the words for a save that failed (core/run/checkpoint.py)."""

from __future__ import annotations

import errno
import os
import random

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException


def state_bytes(*states, device: torch.device) -> int:
    """Bytes of this rank's shards of every tensor, summed over the ranks (collective)."""
    total = 0
    for state in states:
        for value in _tensors(state):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    t = torch.tensor([total], dtype=torch.int64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return int(t.item())


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)


def os_reason(error: BaseException | None) -> str:
    """The OS's words for a failed write — its strerror and errno — found inside torch's
    wrappers (DCP raises a ``CheckpointException`` whose text is every rank's traceback: not a
    message for a user); else the innermost error's class and first line."""
    if error is None:
        return "it failed on another rank (that rank's log says why)"
    seen, stack, last = set(), [error], error
    while stack:
        caught = stack.pop()
        if caught is None or id(caught) in seen:
            continue
        seen.add(id(caught))
        if isinstance(caught, OSError) and caught.errno is not None:
            name = errno.errorcode.get(caught.errno)
            return f"{caught.strerror or os.strerror(caught.errno)} (errno {caught.errno}{f', {name}' if name else ''})"
        if isinstance(caught, CheckpointException):
            stack.extend(f[0] if isinstance(f, tuple) else f for f in caught.failures.values())
        else:
            last = caught
        stack.extend([caught.__cause__, caught.__context__])
    text = "" if isinstance(last, CheckpointException) else str(last).strip().splitlines()[0][:200] if str(last) else ""
    return f"{last.__class__.__name__}{f': {text}' if text else ''}"


def size_words(n: int) -> str:
    """Bytes for a person: 248 bytes, 3.1 MiB, 14.2 GiB."""
    if n < 1024:
        return f"{n} bytes"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def rng_state() -> dict:
    # Python's Mersenne state as a tensor: the file then holds tensors and numbers only
    # and loads with weights_only=True.
    version, words, gauss = random.getstate()
    state = {"python_version": version, "python": torch.tensor(words, dtype=torch.int64), "python_gauss": gauss,
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((state["python_version"], tuple(state["python"].tolist()), state["python_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def plain(value):
    """A scheduler's state as JSON: one-element tensors (torchao keeps lr as a tensor) as numbers."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
