"""The run's one DeviceMesh (dp_replicate x dp_shard x ring x ulysses) and the views hooks use."""

from __future__ import annotations

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from weft.core.mesh_spec import MESH_ORDER, MeshSpec


@attrs.frozen(kw_only=True)
class WeftMesh:
    """The 4-D mesh plus the flattened views made from it, kept rather than re-sliced.

    ``fsdp``: dp_shard x ulysses x ring flattened, so SP ranks share parameter
    shards instead of each holding a replica. ``dp``: dp_replicate x dp_shard,
    the ranks that see different data.
    """

    root: DeviceMesh
    fsdp: DeviceMesh
    dp: DeviceMesh
    sp: DeviceMesh  # ring x ulysses flattened: the ranks sharing one sequence
    spec: MeshSpec

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.root[name]

    def fsdp_mesh(self) -> DeviceMesh:
        """1-D mesh for FSDP, or 2-D (replicate, shard) for HSDP."""
        if self.spec.dp_replicate > 1:
            # Slicing a flattened dim from the root warns in torch >= 2.11, but it is
            # the one way to get a 2-D (replicate, fsdp) mesh from the 4-D one.
            return self.root[("dp_replicate", "fsdp")]
        return self.fsdp

    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas (SP ranks of one group share it)."""
        return self.dp.get_local_rank()


def build_device_mesh(spec: MeshSpec, *, device_type: str) -> WeftMesh:
    shape = tuple(getattr(spec, dim) for dim in MESH_ORDER)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_ORDER)
    fsdp = root[("dp_shard", "ring", "ulysses")]._flatten("fsdp")
    dp = root[("dp_replicate", "dp_shard")]._flatten("dp")
    sp = root[("ring", "ulysses")]._flatten("sp")
    return WeftMesh(root=root, fsdp=fsdp, dp=dp, sp=sp, spec=spec)


def device_for(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
