"""Gradient averaging for replicated parameters and global-norm clipping over DTensor and plain grads."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def average_replicated_grads(params: list[torch.Tensor], *, world_size: int) -> None:
    """All-reduce (mean) the plain-tensor gradients: parameters no FSDP unit owns.

    FSDP2 already reduced DTensor gradients; a plain gradient belongs to a module
    kept whole on every rank, so its rank-local gradients must be averaged.
    """
    plain = [p.grad for p in params if not isinstance(p.grad, DTensor)]
    if world_size == 1 or not plain or not dist.is_initialized():
        return
    flat = torch.cat([g.reshape(-1) for g in plain])  # one collective, not one per tensor
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for grad in plain:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def clip_global_norm(params: list[torch.Tensor], *, max_norm: float,
                     device: torch.device | None = None) -> torch.Tensor:
    """L2 norm over all gradients of all ranks; scale them down to ``max_norm`` if larger.

    Returns the norm before clipping as a plain local tensor on ``device`` (no host
    sync). Sharded (DTensor) gradients contribute their squared local shards, summed
    over their mesh; replicated plain gradients count once. ``device``: where the
    norm is reduced, the process group's device (default: the first gradient's). It
    matters under FSDP2 offload, where sharded gradients live on the CPU while NCCL
    reduces only CUDA tensors.
    """
    grads = [p.grad for p in params]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    device = device if device is not None else grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    if sharded:
        by_mesh: dict[int, list[DTensor]] = {}
        for g in sharded:
            by_mesh.setdefault(id(g.device_mesh), []).append(g)
        for group in by_mesh.values():
            local = _sum_of_squares([g.to_local() for g in group], device)
            mesh = group[0].device_mesh
            # Shard placements: sum the squares over the mesh. HSDP's replicate
            # dimension holds copies, so sum only over the shard dimension.
            shard_dims = [i for i, p in enumerate(group[0].placements) if p.is_shard()]
            for dim in shard_dims:
                dist.all_reduce(local, group=mesh.get_group(dim))
            total_sq = total_sq + local
    if plain:
        total_sq = total_sq + _sum_of_squares(plain, device)
    norm = total_sq.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        for tensors in _by_device_and_dtype(locals_).values():
            # One multi-tensor kernel per device and dtype, not one multiply per gradient.
            torch._foreach_mul_(tensors, scale.to(device=tensors[0].device, dtype=tensors[0].dtype))

    return norm


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements, in float32 (float64 for float64 gradients), on ``device``:
    norms in multi-tensor kernels (``torch._foreach_norm``, as torch's own clip_grad_norm_),
    each computed in the accumulation dtype without a float32 copy of the gradient."""
    parts = []
    for tensors_ in _by_device_and_dtype(tensors).values():
        acc = torch.promote_types(tensors_[0].dtype, torch.float32)
        norms = torch._foreach_norm(tensors_, 2, dtype=acc)
        parts.append(torch.stack(norms).pow(2).sum().to(device=device, dtype=torch.float32))
    return torch.stack(parts).sum()
