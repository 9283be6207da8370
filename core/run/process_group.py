"""The process group's life on one rank: set up before the model is prepared (the device
type, the CUDA allocator's segments, the rendezvous) and torn down once the run is over."""

from __future__ import annotations

import datetime
import gc
import os
from typing import Any

import torch
import torch.distributed as dist

from weft.core.recipe import Recipe


def device_type_for(recipe: Recipe) -> str:
    """``parallel.device``: cuda, cpu, or (auto) cuda where a GPU is present."""
    want = recipe.parallel.device
    return "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"


def use_expandable_segments() -> None:
    """The CUDA caching allocator grows segments instead of fragmenting, unless the user's
    own ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise. Set in the allocator itself, not only
    in the environment: the environment is read once, when CUDA starts, and an import may
    start it before this runs (transformers imports torchao where it is installed, which
    queries the GPU): the 32K recipe then ran out of memory at step 2 with 11.5 GiB
    reserved but unallocated (BENCHMARKS.md)."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # processes this one starts
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")


def init_process_group(recipe: Recipe) -> tuple[int, int, int, str, Any]:
    """(rank, world_size, local_rank, device_type, store); a single process gets a one-rank
    group. ``store``: the rendezvous store the ranks share (heartbeats: core/run/peer_watch.py)."""
    device_type = device_type_for(recipe)
    if device_type == "cuda" and recipe.parallel.expandable_segments:
        use_expandable_segments()
    backend = recipe.parallel.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ:  # started by torchrun / the elastic launcher
            timeout = datetime.timedelta(minutes=10)
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            # A restarted round may share the launcher's store with the round that failed: a
            # prefix per attempt keeps its ranks from reading the dead ranks' addresses.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"weft/attempt_{attempt}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    else:  # already initialised by an embedding program: its store, which torch keeps
        store = dist.distributed_c10d._get_default_store()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return dist.get_rank(), dist.get_world_size(), local_rank, device_type, store


def close_process_group(*, clean: bool) -> None:
    """Tear every process group down while the interpreter is still whole.

    ``clean``: this rank finished without an error, so every rank reaches this point;
    a barrier first keeps a fast rank from closing connections a slower peer's last
    collective still uses. After an error a one-rank group is still destroyed (a
    library caller may start another run); a multi-rank one is left alone, since the
    peers may never arrive and the launcher stops them.

    Models wrapped by FSDP and device meshes sit in reference cycles that hold
    sub-groups (and their Gloo work threads); left to the collector at interpreter
    exit, they are destroyed while modules are being cleared, which aborts the
    process now and then ("terminate called without an active exception"; seen once
    in about a hundred two-rank `weft check` runs on two busy cores). Collecting them
    here, before destroying the groups, avoids that.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        if not clean:
            return
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
