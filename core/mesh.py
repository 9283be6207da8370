"""The run's one DeviceMesh (dp_replicate x dp_shard x ulysses x ring) and views of it."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from weft.core.mesh_spec import DIMS, MeshSpec


def build_device_mesh(spec: MeshSpec, *, device_type: str) -> DeviceMesh:
    mesh = init_device_mesh(device_type, spec.shape, mesh_dim_names=DIMS)
    # FSDP shards over dp_shard and the SP ranks together, so SP ranks never each
    # hold a full replica; HSDP replicates across dp_replicate.
    mesh[("dp_shard", "ulysses", "ring")]._flatten("fsdp")
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    return mesh


def fsdp_mesh(mesh: DeviceMesh, spec: MeshSpec) -> DeviceMesh:
    """1-D mesh for FSDP, or 2-D (replicate, shard) for HSDP."""
    if spec.dp_replicate > 1:
        return mesh[("dp_replicate", "fsdp")]
    return mesh["fsdp"]


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among data-parallel replicas (SP ranks of one group share it)."""
    return mesh["dp"].get_local_rank()


def device_for(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
