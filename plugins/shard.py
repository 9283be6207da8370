"""Shard hook: FSDP2 per unit with per-group precision, or no sharding."""

from __future__ import annotations

from weft.core.hookspecs import hookimpl
from weft.core.registry import Strategy
from weft.plugins.float8_units import describe, float8_units
from weft.plugins.shard_params import Fsdp2Params, KeepParams, check_keep


@hookimpl
def weft_strategies():
    return [
        Strategy(point="shard", name="fsdp2", params=Fsdp2Params,
                 summary="FSDP2 fully_shard per unit over dp_shard x SP ranks", check=check_keep, describe=describe,
                 shard_dims=("dp_shard", "ring", "ulysses"),
                 gathers=True),
        Strategy(point="shard", name="none", params=KeepParams,
                 summary="keep the module whole on every rank; grad_sync averages its gradients", check=check_keep,
                 describe=describe,
                 shard_dims=()),
    ]


@hookimpl
def weft_shard(model, plan, mesh, ctx):
    from weft.strategies.memory.activation_checkpoint import apply_checkpointing
    from weft.strategies.model.fsdp2 import ShardGroup, apply_fsdp2

    # Activation checkpointing first, on every unit whose rule asks for it, whatever
    # its sharding: torch's order is checkpointing, then FSDP.
    _check_storage(plan)
    _cast_storage(model, plan)
    converted = float8_units(model, plan, device=ctx.device)  # module swaps: before checkpointing and compile
    if converted:
        ctx.log.info("shard.float8", layers=converted)
    frozen = plan.frozen_units()
    for path in frozen:
        model.get_submodule(path).requires_grad_(False)
    if frozen:
        ctx.log.info("shard.frozen", units=len(frozen), parameters=sum(
            p.numel() for path in frozen for p in model.get_submodule(path).parameters()))
    # No backward at eval and generate (ctx.inference): recomputation and activation offload
    # would only add hooks, which broke the compiled decoding step in every layer (torch 2.11).
    checkpointed = 0 if ctx.inference else sum(
        apply_checkpointing(model.get_submodule(unit.info.path), mode=unit.get("shard").params.checkpoint)
        for unit in plan.modules_for("shard")
        if unit.info.kind == "unit" and unit.get("shard").strategy in ("fsdp2", "none")
    )
    if checkpointed:
        ctx.log.info("shard.checkpointing", modules=checkpointed)
    compiled, children = _compile_units(model, plan)
    if compiled:
        ctx.log.info("shard.compile", modules=compiled)
    if children:  # compile_scope = "unit" asked, an attention torch cannot trace inside: child by child instead
        ctx.log.warning("shard.compile_scope_children", units=len(children), first=children[0],
                        reason="an attention inside runs collectives or is the vision tower's")
    tiled = _tile_mlps(model, plan)
    if tiled:
        ctx.log.info("shard.tiled_mlp", modules=tiled)
    offloaded = [model.get_submodule(unit.info.path) for unit in plan.modules_for("shard") if not ctx.inference
                 and unit.info.kind == "unit" and getattr(unit.get("shard").params, "offload_activations", False)]
    if offloaded:
        from weft.strategies.memory.activation_offload import ActivationOffload

        ActivationOffload(device=ctx.device).attach(offloaded)
        ctx.log.info("shard.offload_activations", units=len(offloaded))
    units = plan.modules_for("shard", "fsdp2")
    root = plan.root()
    if not units:
        return None
    root_fsdp = root.get("shard").strategy == "fsdp2"
    groups = []
    # The fused loss reads the head's weights after the model's forward: they join the root
    # unit, which FSDP2 keeps gathered from forward to backward (core/train/step.py FusedHead).
    # A tied head shares its weight with the embedding: one parameter, so one FSDP unit (the
    # root), where FSDP2 keeps it shared through to_empty and the gathers.
    fused = ctx.recipe.train.loss == "fused"
    from weft.core.models import ties_embeddings

    tied = ties_embeddings(getattr(model, "config", None))  # any module may be sharded, not only transformers
    in_root = {"head", "embedding"} if tied else {"head"} if fused else set()
    separate = [u for u in units if u.info.kind == "unit" and u.info.modality not in in_root]
    if in_root:
        ctx.log.info("shard.in_root", modalities=sorted(in_root), fused_loss=fused, tied_embeddings=tied)
    # Deepest first: a path with more dots is inside a shallower one.
    for unit in sorted(separate, key=lambda u: -u.info.path.count(".")):
        params = unit.get("shard").params
        groups.append(ShardGroup(modules=(model.get_submodule(unit.info.path),), **_policy(params)))
    if not root_fsdp:
        raise_mixed = [u.info.path for u in units if u.info.kind == "unit"]
        from weft.core.errors import PlanError

        raise PlanError(
            f"units {raise_mixed[:3]}... use fsdp2 but the root uses 'none'; FSDP2 needs the root sharded too "
            "(give the root module, path = \"\", shard = { strategy = \"fsdp2\" })"
        )
    root_policy = _policy(root.get("shard").params)
    if fused:  # gathered from forward to backward, so the loss can read the head's weights
        root_policy["reshard_after_forward"] = False
    quantized = plan.quantized_units()
    four_bit = [u for u in units if u.info.path in quantized]
    if four_bit:
        # FSDP2 shards a 4-bit weight as torchao's NF4 tensor (its chunks, and all-gather hooks
        # that rebuild it), so the weights are quantised before fully_shard: the model is
        # materialised here, unit by unit (each unit's linears quantised before the next one
        # exists in full precision: the rank holds the 4-bit model and one unit at a time),
        # then sharded; the core finds it materialised. Without 4-bit units the model is
        # sharded on the meta device and each rank materialises only its shards.
        ctx.adapter.materialize(model, ctx.recipe, device=ctx.device, seed=ctx.recipe.train.seed, log=ctx.log,
                                quantize=quantized)
        ctx.log.info("shard.quantized_before_fsdp2", units=len(four_bit))
        _check_splits(model, units=four_bit, ranks=mesh.fsdp_mesh().size())
    apply_fsdp2(groups=groups, root=model, root_group=ShardGroup(modules=(model,), **root_policy),
                mesh=mesh.fsdp_mesh())
    ctx.log.info("shard.fsdp2", units=len(groups), mesh=list(plan.mesh.shape))
    return None


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


def _check_storage(plan) -> None:
    """Under an FSDP2 root, an unsharded unit's weights join the root's group, which FSDP2
    keeps in one dtype: the unit must store what the root stores."""
    root = plan.root().get("shard")
    if root.strategy != "fsdp2":
        return
    want = root.params.storage_dtype or "float32"
    for m in plan.modules_for("shard", "none"):
        have = m.get("shard").params.storage_dtype or "float32"
        if m.info.kind == "unit" and have != want:
            from weft.core.errors import PlanError

            raise PlanError(f"unit {m.info.path!r} keeps its weights whole (shard strategy 'none') in {have}, inside "
                            f"an FSDP2 root stored in {want}; FSDP2 gathers them with the root's, in one dtype: give "
                            f"it storage_dtype = {want!r}, or shard it with strategy 'fsdp2'",
                            where=f"{m.get('shard').source} (shard.storage_dtype)")


def _tile_mlps(model, plan) -> int:
    """``mlp_tile_tokens``: each unit's ``mlp`` child applied in tiles (one TiledMLP per tile size)."""
    from weft.strategies.memory.tiled_mlp import TiledMLP

    by_size: dict[int, list] = {}
    for unit in plan.modules_for("shard"):
        size = getattr(unit.get("shard").params, "mlp_tile_tokens", 0)
        mlp = getattr(model.get_submodule(unit.info.path), "mlp", None) if unit.info.kind == "unit" else None
        if size and mlp is not None:
            by_size.setdefault(size, []).append(mlp)
    return sum(TiledMLP(tile_tokens=size).attach(mlps) for size, mlps in by_size.items())


def _cast_storage(model, plan) -> None:
    """Storage dtypes of sharded and unsharded units alike, before sharding (an unset one is
    float32, so a bf16 parent's rule does not reach a child that asks for nothing)."""
    from weft.strategies.model.fsdp2 import cast_storage

    cast_storage(model, [(model.get_submodule(m.info.path), m.get("shard").params.storage_dtype or "float32")
                         for m in plan.modules_for("shard")
                         if m.info.kind in ("unit", "root") and m.get("shard").strategy in ("fsdp2", "none")])


def _compile_units(model, plan) -> tuple[int, list[str]]:
    """``compile = true``: the unit's children, its attention too where one kernel on the local
    sequence runs it (fused rotary embedding and casts around the kernel; no collectives).
    Returns the modules compiled, and the units asking ``compile_scope = "unit"`` that hold an
    attention torch cannot trace (compiled child by child)."""
    from weft.plugins.attention import traceable
    from weft.strategies.memory.compile_units import compile_unit

    attention = {m.info.path: traceable(m.get("attention"), m.info.path, plan) for m in plan.modules_for("attention")}
    compiled, children = 0, []
    for unit in plan.modules_for("shard"):
        params = unit.get("shard").params
        if unit.info.kind == "unit" and getattr(params, "compile", False):
            inside = [flag for path, flag in attention.items() if path.startswith(unit.info.path + ".")]
            traced = bool(inside) and all(inside)
            whole = getattr(params, "compile_scope", "children") == "unit"
            children += [unit.info.path] if whole and not traced else []
            compiled += compile_unit(model.get_submodule(unit.info.path), attention=traced,
                                     skip=("mlp",) if getattr(params, "mlp_tile_tokens", 0) > 0 else (),
                                     whole=traced and whole)
    return compiled, children


def _policy(params) -> dict:
    return {
        "param_dtype": params.param_dtype,
        "reduce_dtype": params.reduce_dtype,
        "reshard_after_forward": params.reshard_after_forward,
        "offload": params.offload,
    }
