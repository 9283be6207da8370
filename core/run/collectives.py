"""The few scalar collectives the loop's bookkeeping needs (stop flags, checkpoint checks, maxima).

Each is a no-op on one rank. The device: gloo reduces CPU tensors, NCCL the rank's GPU ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(device: torch.device) -> torch.device:
    """Where a scalar for a collective lives: ``device`` under NCCL, the CPU otherwise."""
    return device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def global_max(value: int, *, device: torch.device) -> int:
    """The largest ``value`` over the ranks (collective: call on every rank)."""
    t = torch.tensor([value], dtype=torch.int64, device=collective_device(device))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool, *, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any (collective: call on every rank)."""
    return bool(global_max(int(flag), device=device))
