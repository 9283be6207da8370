"""Random init that depends neither on the world size nor on the device.

Every value is a pure function of (seed, parameter name, global row index): the rows of
each parameter are cut into blocks of ``block_rows`` rows of the GLOBAL tensor, and each
block is drawn on the CPU from its own ``torch.Generator``, seeded from a stable hash of
(seed, name, block index). A rank draws only the blocks that overlap its shard, slices
them and copies the slice to the shard's device and dtype. So a model sharded by FSDP2
over any number of ranks, on any device, holds exactly the values the same call gives a
whole model on one CPU; no rank ever holds more than its shard plus one block.

Which values follow transformers' ``_init_weights``: normal(0, std) for the weights of
Linear, Embedding and convolutions (the embedding's padding row zero), zeros for biases,
ones for the weights of normalisation layers; parameters of other modules: 1-D zeros,
the rest normal(0, std).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

#: Prefixes wrappers insert in parameter names (checkpoint_wrapper, torch.compile, FSDP1, and
#: PEFT's adapter layers, which keep the layer they wrap as ``base_layer``): dropped before
#: hashing, so wrapping a model does not change its values.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "base_layer.")
_NORMAL_KINDS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)
# BatchNorm/GroupNorm do not end with "Norm" but are normalisations all the same.
_NORM_KINDS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase)


def init_parameters(model: torch.nn.Module, *, seed: int, std: float, block_rows: int = 1024,
                    only: frozenset[str] | None = None, include: Callable[[str], bool] | None = None) -> int:
    """Fill every parameter of ``model`` in place (plain tensors or DTensors sharded on any
    dims, e.g. FSDP2's Shard(0) or HSDP's (Replicate, Shard(0))). Their storage must exist
    (after ``to_empty``); buffers are left alone. ``only``: fill just the parameters of these
    names (without wrapper prefixes), e.g. the adapters added to a model already filled;
    ``include``: just those whose name (as ``named_parameters`` gives it) it accepts, e.g. one
    unit's (strategies/model/materialize.py). Returns the number of parameters filled."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    modules = dict(model.named_modules())
    count = 0
    normal = []  # (local, global shape, offset, key, padding row): drawn together below
    with torch.no_grad():
        for name, param in model.named_parameters():
            if (only is not None and _canonical(name) not in only) or (include is not None and not include(name)):
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = modules[owner_name]
            local, offset = _local_part(param, name=name)
            kind = _kind(owner, leaf=leaf, ndim=param.ndim)
            if local.numel() == 0:
                pass  # an uneven shard can hold no rows at all
            elif kind == "ones":
                local.fill_(1.0)
            elif kind == "zeros":
                local.zero_()
            else:
                padding_row = owner.padding_idx if isinstance(owner, torch.nn.Embedding) else None
                normal.append((local, tuple(param.shape), offset, _canonical(name), padding_row))
            count += 1
        _fill_normals(normal, seed=seed, std=std, block_rows=block_rows)
    return count


def zero_parameters(model: torch.nn.Module, *, only: frozenset[str]) -> int:
    """Zero the parameters of these names (without wrapper prefixes), sharded or whole."""
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if _canonical(name) in only:
                (param.to_local() if isinstance(param, DTensor) else param.data).zero_()
                count += 1
    return count


def _kind(owner: torch.nn.Module, *, leaf: str, ndim: int) -> str:
    """"normal", "ones" or "zeros", by the owning module's kind (transformers' conventions)."""
    name = type(owner).__name__
    if isinstance(owner, _NORM_KINDS) or name.endswith("Norm") or name.endswith("RMSNorm"):
        return "zeros" if leaf == "bias" else "ones"
    if isinstance(owner, _NORMAL_KINDS):
        return "normal" if leaf == "weight" else "zeros"
    return "zeros" if ndim <= 1 else "normal"


def _canonical(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _local_part(param: torch.Tensor, *, name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the tensor this rank writes, its offset in the global tensor, per dim)."""
    if not isinstance(param, DTensor):
        return param.data, (0,) * param.ndim
    for placement in param.placements:
        # Partial has no rows of its own; a strided shard's rows are not one contiguous range.
        if type(placement) not in (Shard, Replicate):
            raise ValueError(f"{name}: placement {placement} is not supported (Shard or Replicate only)")
    local = param.to_local()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the expected {tuple(shape)}")
    return local, tuple(offset)


def _fill_normals(jobs: list, *, seed: int, std: float, block_rows: int) -> None:
    """Fill each job's ``local`` (its rank's part of a parameter) with its normal draws.

    Each block has its own generator, so blocks drawn on several threads (torch's normal_
    releases the GIL; one generator draws on one core) are the same values as drawn in turn;
    the blocks of every parameter of the call are drawn together (a unit's small and large
    matrices keep all cores busy): a 72B model's 72e9 values take minutes on one core. A
    thread per core, two blocks in flight per thread (each up to block_rows x the widest row,
    ~120 MB at 72B's MLP): bounded host memory. Measured on one H200 host (16 cores, then 8
    threads a parameter, float32 copies): 72B's random init and 4-bit quantisation in 172 s."""
    tasks = []  # (job, block index)
    for job, (local, global_shape, offset, key, _) in enumerate(jobs):
        if not global_shape:  # a 0-D parameter: one block of one value
            local.copy_(_block(seed=seed, key=key, index=0, shape=(), std=std))
            continue
        first, stop = offset[0], offset[0] + local.shape[0]  # this rank's global rows [first, stop)
        tasks += [(job, index) for index in range(first // block_rows, (stop - 1) // block_rows + 1)]
    if not tasks:
        return

    def draw(task: tuple[int, int]) -> tuple[int, int, int, torch.Tensor]:
        """Job ``job``'s rows [lo, hi) of block ``index``, already in the shard's dtype (rounded
        on the drawing thread, as the copy would round it: half the bytes to move for bf16)."""
        job, index = task
        local, global_shape, offset, key, padding_row = jobs[job]
        start = index * block_rows
        block = _block(seed=seed, key=key, index=index,
                       shape=(min(block_rows, global_shape[0] - start), *global_shape[1:]), std=std)
        if padding_row is not None and start <= padding_row < start + block.shape[0]:
            block[padding_row - start] = 0.0
        first, stop = offset[0], offset[0] + local.shape[0]
        # The other dims: whole unless the placement shards them too.
        inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
        lo, hi = max(first, start), min(stop, start + block.shape[0])
        return job, lo - first, hi - first, block[(slice(lo - start, hi - start), *inner)].to(local.dtype)

    workers = max(1, min(len(tasks), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        window = 2 * workers  # blocks drawn ahead of the copies
        for at in range(0, len(tasks), window):
            for job, lo, hi, rows in pool.map(draw, tasks[at:at + window]):
                jobs[job][0][lo:hi].copy_(rows)


def _block(*, seed: int, key: str, index: int, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """One block, always drawn whole: CPU ``normal_`` takes a different path for small
    tensors, so values depend on the block's size, which must not depend on the shard."""
    digest = hashlib.sha256(f"{seed}\0{key}\0{index}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
