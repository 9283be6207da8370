"""Run a function on N gloo ranks in fresh processes; a failure on any rank fails the test."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple) -> None:
    # One thread per rank: N ranks share the machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; raises if any rank raised."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world, join=True, start_method="spawn")
