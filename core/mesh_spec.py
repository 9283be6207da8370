"""The device-mesh shape of a run, resolved and checked before any process group starts.

Pure: imports no torch. One dimension order for the spec and the live mesh
(``MESH_ORDER``, outermost first): dp_replicate, dp_shard, ring, ulysses. Ulysses is
innermost so its all-to-all runs between neighbouring ranks (one host); the ring's
point-to-point steps may span hosts.
"""

from __future__ import annotations

import math

import attrs

from weft.core.errors import PlanError
from weft.core.recipe import ParallelSection

MESH_ORDER: tuple[str, ...] = ("dp_replicate", "dp_shard", "ring", "ulysses")


@attrs.frozen(kw_only=True)
class MeshSpec:
    dp_replicate: int = 1
    dp_shard: int = 1
    ulysses: int = 1
    ring: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        """Degrees in ``MESH_ORDER``."""
        return tuple(getattr(self, d) for d in MESH_ORDER)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def resolve_mesh(parallel: ParallelSection, *, world_size: int, heads: int | None, where: str) -> MeshSpec:
    """Fill ``dp_shard = -1`` and ``ulysses = "auto"`` and check the product.

    ``ulysses = "auto"``: the largest degree that divides both the text model's
    query heads and the ranks left after dp_replicate, ring and (if given) dp_shard.
    ``dp_shard = -1`` then takes whatever is left.
    """
    if world_size < 1:
        raise PlanError(f"world size must be >= 1, got {world_size}", where="--world-size")
    fixed = parallel.dp_replicate * parallel.ring * (parallel.dp_shard if parallel.dp_shard > 0 else 1)
    if parallel.ulysses == "auto":
        room = world_size // fixed if world_size % fixed == 0 else 1
        limit = heads or 1
        ulysses = max(d for d in range(1, room + 1) if room % d == 0 and limit % d == 0)
    else:
        ulysses = parallel.ulysses
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        rest = parallel.dp_replicate * ulysses * parallel.ring
        if world_size % rest:
            raise PlanError(
                f"dp_replicate({parallel.dp_replicate}) * ulysses({ulysses}) * ring({parallel.ring}) = {rest} "
                f"does not divide world_size({world_size}), so parallel.dp_shard = -1 cannot fill it",
                where=where,
            )
        dp_shard = world_size // rest
    spec = MeshSpec(dp_replicate=parallel.dp_replicate, dp_shard=dp_shard, ulysses=ulysses, ring=parallel.ring)
    if spec.world_size != world_size:
        factors = " * ".join(f"{d}({getattr(spec, d)})" for d in MESH_ORDER)
        raise PlanError(f"{factors} = {spec.world_size} != world_size({world_size})", where=where)
    return spec
