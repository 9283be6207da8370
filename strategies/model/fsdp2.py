"""FSDP2 (``fully_shard``) applied per unit, deepest first, each with its own precision policy."""

from __future__ import annotations

from typing import Iterable

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen(kw_only=True)
class ShardGroup:
    """One fully_shard call: the modules of one unit and its policy."""

    modules: tuple[torch.nn.Module, ...]
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    offload: bool = False


def apply_fsdp2(
    *, groups: Iterable[ShardGroup], root: torch.nn.Module, root_group: ShardGroup | None, mesh: DeviceMesh
) -> None:

    """Shard each group's modules, then the root, over ``mesh`` (1-D FSDP or 2-D HSDP).

    Order matters: children are wrapped before their parents so each parameter
    belongs to the innermost unit; the root call gathers whatever is left. Storage
    dtypes are set before (``cast_storage``), for sharded and unsharded units alike.
    """
    # Pinned host memory needs an accelerator; on a CPU run offloading is a no-op anyway.
    pin = mesh.device_type == "cuda"
    for group in groups:
        modules = group.modules[0] if len(group.modules) == 1 else list(group.modules)
        fully_shard(modules, mesh=mesh, **_policy(group, pin=pin))
    fully_shard(root, mesh=mesh, **(_policy(root_group, pin=pin) if root_group else {}))


def cast_storage(root: torch.nn.Module, assignments: Iterable[tuple[torch.nn.Module, str]]) -> None:
    """Each module's parameters to its storage dtype, shallowest module first, so a unit's own
    rule wins over its parent's (the root's covers whatever no unit owns)."""
    depth = {id(m): (n.count(".") + 1 if n else 0) for n, m in root.named_modules()}
    for module, dtype in sorted(assignments, key=lambda pair: depth[id(pair[0])]):
        cast_parameters(module, DTYPES[dtype])


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Parameters (not buffers: rotary tables stay float32) to ``dtype``, in place."""
    count = 0
    for param in module.parameters():
        if param.dtype != dtype and param.is_floating_point():
            param.data = param.data.to(dtype)
            count += 1
    return count


def _policy(group: ShardGroup, *, pin: bool) -> dict:
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[group.param_dtype] if group.param_dtype else None,
        reduce_dtype=DTYPES[group.reduce_dtype] if group.reduce_dtype else None,
    )
    return {
        "mp_policy": mp,
        "reshard_after_forward": group.reshard_after_forward,
        "offload_policy": CPUOffloadPolicy(pin_memory=pin) if group.offload else OffloadPolicy(),
    }
