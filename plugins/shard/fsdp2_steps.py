"""The sharding steps of a strategy that shards with FSDP2: its plan checks, the 4-bit units
quantised before ``fully_shard``, and ``fully_shard`` per unit then the root.

A unit is sharded when its params carry the ``Fsdp2`` config's fields (plugins/shard/params.py's
Fsdp2Params does), whatever its strategy is named: the same test says whether the root is."""

from __future__ import annotations

from typing import Literal

import attrs

from weft.plugins.shard.levers import Storage, config_of, configured

Dtype = Literal["float32", "bfloat16", "float16"]


@attrs.frozen(kw_only=True)
class Fsdp2:
    """One unit's ``fully_shard`` policy (strategies/model/fsdp2.py's ShardGroup)."""

    param_dtype: Dtype | None = None
    reduce_dtype: Dtype | None = None
    reshard_after_forward: bool = True
    offload: bool = False


@attrs.frozen(kw_only=True)
class Quantize:
    """``quantize``: the unit's frozen linear weights stored in 4 bits as it materialises."""

    quantize: Literal["none", "nf4"] = "none"


def sharded(unit) -> bool:
    """Whether FSDP2 shards this module (its params carry the Fsdp2 config)."""
    decision = unit.get("shard")
    return decision is not None and config_of(decision.params, Fsdp2) is not None


def check_root(units, *, plan) -> None:
    """FSDP2 shards the root too when it shards any unit: the root's rule must say so."""
    root = plan.root()
    mixed = [u.info.path for u, _ in configured(units, Fsdp2)]
    if mixed and not sharded(root):
        from weft.core.errors import PlanError

        raise PlanError(
            f"units {mixed[:3]}... use fsdp2 but the root uses {root.get('shard').strategy!r}; FSDP2 needs the root "
            "sharded too (give the root module, path = \"\", shard = { strategy = \"fsdp2\" })"
        )


def check_storage(units, *, plan) -> None:
    """Under an FSDP2 root, an unsharded unit's weights join the root's group, which FSDP2
    keeps in one dtype: the unit must store what the root stores."""
    root = plan.root()
    if not sharded(root):
        return
    want = (config_of(root.get("shard").params, Storage) or Storage()).storage_dtype or "float32"
    for m, config in configured(units, Storage):
        have = config.storage_dtype or "float32"
        if not sharded(m) and have != want:
            from weft.core.errors import PlanError

            raise PlanError(f"unit {m.info.path!r} keeps its weights whole (shard strategy "
                            f"{m.get('shard').strategy!r}) in {have}, inside an FSDP2 root stored in {want}; FSDP2 "
                            f"gathers them with the root's, in one dtype: give it storage_dtype = {want!r}, or shard "
                            "it with strategy 'fsdp2'", where=f"{m.get('shard').source} (shard.storage_dtype)")


def quantize_before_sharding(model, units, *, plan, mesh, ctx) -> None:
    """FSDP2 shards a 4-bit weight as torchao's NF4 tensor (its chunks, and all-gather hooks
    that rebuild it), so where a sharded unit is 4-bit the weights are materialised now, each
    unit quantised before the next one exists in full precision (the rank holds the 4-bit
    model and one unit at a time), then sharded; the core finds the model materialised.
    Without 4-bit units the model is sharded on the meta device and each rank materialises
    only its shards."""
    from weft.core.train.weights import materialize_weights

    four_bit = [u for u, config in configured(units, Quantize) if config.quantize != "none" and sharded(u)]
    if not four_bit:
        return
    materialize_weights(model, family=ctx.family, recipe=ctx.recipe, plan=plan, device=ctx.device, log=ctx.log)
    ctx.log.info("shard.quantized_before_fsdp2", units=len(four_bit))
    _check_splits(model, units=four_bit, ranks=mesh.fsdp_mesh().size())


def fsdp2(model, units, *, plan, mesh, ctx) -> None:
    """``fully_shard`` on each sharded unit, deepest first, each with its rule's policy, then
    the root (whatever no unit owns)."""
    from weft.core.models import ties_embeddings
    from weft.strategies.model.fsdp2 import ShardGroup, apply_fsdp2

    # The fused loss reads the head's weights after the model's forward: they join the root
    # unit, which FSDP2 keeps gathered from forward to backward (core/train/step.py FusedHead).
    # A tied head shares its weight with the embedding: one parameter, so one FSDP unit (the
    # root), where FSDP2 keeps it shared through to_empty and the gathers.
    fused = ctx.recipe.train.loss == "fused"
    tied = ties_embeddings(getattr(model, "config", None))  # any module may be sharded, not only transformers
    in_root = {"head", "embedding"} if tied else {"head"} if fused else set()
    if in_root:
        ctx.log.info("shard.in_root", modalities=sorted(in_root), fused_loss=fused, tied_embeddings=tied)
    separate = [(u, c) for u, c in configured(units, Fsdp2) if u.info.modality not in in_root]
    # Deepest first: a path with more dots is inside a shallower one.
    groups = [ShardGroup(modules=(model.get_submodule(unit.info.path),), **attrs.asdict(config))
              for unit, config in sorted(separate, key=lambda pair: -pair[0].info.path.count("."))]
    root_policy = attrs.asdict(config_of(plan.root().get("shard").params, Fsdp2))
    if fused:  # gathered from forward to backward, so the loss can read the head's weights
        root_policy["reshard_after_forward"] = False
    apply_fsdp2(groups=groups, root=model, root_group=ShardGroup(modules=(model,), **root_policy),
                mesh=mesh.fsdp_mesh())
    ctx.log.info("shard.fsdp2", units=len(groups), mesh=list(plan.mesh.shape))


def _check_splits(model, *, units, ranks: int) -> None:
    """Every 4-bit weight of an FSDP2 unit splits evenly over the shard ranks (torchao's NF4
    chunks have no padding): else the rule's error, before fully_shard fails inside torchao."""
    from weft.core.errors import PlanError
    from weft.strategies.model.quantize import unshardable

    for unit in units:
        found = unshardable(model.get_submodule(unit.info.path), ranks=ranks)
        if found is not None:
            decision = unit.get("shard")
            raise PlanError(f"shard rule {decision.rule!r} ({decision.source}): quantize = 'nf4' under FSDP2 over "
                            f"{ranks} ranks splits each 4-bit weight evenly; {unit.info.path}.{found[0]} has "
                            f"{found[1]}; use a shard degree that divides them, or shard strategy 'none' for "
                            "these units")
