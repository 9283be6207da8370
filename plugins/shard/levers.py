"""The shard levers: what a unit's shard rule asks of it besides its sharding, one function each,
applied in order (``LEVERS``) by any shard strategy's ``apply``.

Each lever has a small frozen config; it acts on the units whose params carry that config's
fields under the same names (the built-in params, plugins/shard/params.py, carry all of them),
or hold an instance of it: a third-party strategy's params class that has the same fields
gets the same lever. Every lever takes ``(model, units, *, plan, ctx)``, ``units`` the Plan's
shard modules (``Strategy.impl``; plugins/shard/__init__.py). The algorithms are in
strategies/memory/ and strategies/model/.

Order: storage dtypes, float8's module swaps (before recomputation and compile see the
layers), freezing, activation checkpointing, compile, tiled MLP, activation offload; then the
strategy's own sharding (plugins/shard/fsdp2_steps.py): torch's order is checkpointing, compile, FSDP.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import attrs

T = TypeVar("T")
Dtype = Literal["float32", "bfloat16", "float16"]


@attrs.frozen(kw_only=True)
class Storage:
    """``cast_storage``: the dtype the module's weights (and so its gradients and AdamW states)
    are kept in; None = float32."""

    storage_dtype: Dtype | None = None


@attrs.frozen(kw_only=True)
class Float8:
    """``float8``: the unit's linear layers multiply in float8 (``matmul = "float8"``)."""

    matmul: Literal["default", "float8"] = "default"
    float8_recipe: str = "tensorwise"
    float8_emulate: bool = False


@attrs.frozen(kw_only=True)
class Freeze:
    """``freeze``: ``trainable = false`` takes the unit's parameters out of training."""

    trainable: bool = True


@attrs.frozen(kw_only=True)
class Recompute:
    """``recompute``: the unit's activation checkpointing mode (strategies/memory/activation_checkpoint.py)."""

    checkpoint: str = "off"


@attrs.frozen(kw_only=True)
class Compile:
    """``compile_units``: torch.compile the unit's children, or the unit as one graph."""

    compile: bool = False
    compile_scope: Literal["children", "unit"] = "children"


@attrs.frozen(kw_only=True)
class TiledMlp:
    """``tiled_mlp``: the unit's ``mlp`` child applied in tiles of this many tokens; 0 = off."""

    mlp_tile_tokens: int = 0


@attrs.frozen(kw_only=True)
class Offload:
    """``offload_activations``: a fully checkpointed unit's input waits in host memory."""

    offload_activations: bool = False
    offload_keep_every: int = 1


def config_of(params, config: type[T]) -> T | None:
    """The lever config ``config`` a unit's params carry: an attribute holding one, else one
    made of the params' fields of the same names; None when the params lack any of them
    (the lever leaves the unit alone)."""
    if attrs.has(type(params)):
        held = next((v for v in attrs.astuple(params, recurse=False) if isinstance(v, config)), None)
        if held is not None:
            return held
    names = [field.name for field in attrs.fields(config)]
    if not all(hasattr(params, name) for name in names):
        return None
    return config(**{name: getattr(params, name) for name in names})


def configured(units, config: type[T], *, kinds: tuple[str, ...] = ("unit",)) -> list[tuple[object, T]]:
    """(module plan, its ``config``) for the ``units`` of these kinds whose params carry it."""
    found = []
    for unit in units:
        decision = unit.get("shard")
        chosen = config_of(decision.params, config) if decision is not None and unit.info.kind in kinds else None
        if chosen is not None:
            found.append((unit, chosen))
    return found


def cast_storage(model, units, *, plan, ctx) -> None:
    """Storage dtypes of sharded and unsharded units and the root alike, before sharding (an
    unset one is float32, so a bf16 parent's rule does not reach a child that asks for nothing)."""
    from weft.strategies.model.fsdp2 import cast_storage as cast

    cast(model, [(model.get_submodule(unit.info.path), config.storage_dtype or "float32")
                 for unit, config in configured(units, Storage, kinds=("unit", "root"))])


def float8(model, units, *, plan, ctx) -> None:
    """``matmul = "float8"``: the units' eligible linear layers swapped for torchao's."""
    from weft.plugins.shard.float8_units import float8_units

    converted = float8_units(model, [(u, c) for u, c in configured(units, Float8) if c.matmul == "float8"],
                             device=ctx.device)
    if converted:
        ctx.log.info("shard.float8", layers=converted)


def freeze(model, units, *, plan, ctx) -> None:
    """``trainable = false``: no gradients, no optimizer state; the forward still runs and
    gradients still flow through the unit to the ones before."""
    frozen = [model.get_submodule(unit.info.path) for unit, config in configured(units, Freeze)
              if not config.trainable]
    for module in frozen:
        module.requires_grad_(False)
    if frozen:
        ctx.log.info("shard.frozen", units=len(frozen),
                     parameters=sum(p.numel() for module in frozen for p in module.parameters()))


def recompute(model, units, *, plan, ctx) -> None:
    """Activation checkpointing of each unit whose rule asks for it. None at inference
    (``ctx.inference``): with no backward its hooks only cost, and they broke the compiled
    decoding step in every layer (torch 2.11). A recomputed SwiGLU MLP of plain linear layers
    (untiled) keeps its input and is made again by hand in its backward, without its down
    product (``recomputed_swiglu``; strategies/memory/tiled_mlp.py): under the "mlp" mode that
    is its whole recomputation, under "full" and "except_attention" the unit's stops before it."""
    from weft.strategies.memory.activation_checkpoint import apply_checkpointing
    from weft.strategies.memory.tiled_mlp import TiledMLP

    checkpointed, by_hand = 0, {False: [], True: []}
    for unit, config in ([] if ctx.inference else configured(units, Recompute)):
        module = model.get_submodule(unit.info.path)
        swiglu = recomputed_swiglu(module, unit, config)
        if swiglu is not None:
            compiled = config_of(unit.get("shard").params, Compile)
            by_hand[compiled is not None and compiled.compile].append(swiglu)
        if swiglu is None or config.checkpoint != "mlp":
            checkpointed += apply_checkpointing(module, mode=config.checkpoint)
    kept = sum(TiledMLP(tile_tokens=None, compile=compiled).attach(mlps) for compiled, mlps in by_hand.items() if mlps)
    if checkpointed or kept:
        ctx.log.info("shard.checkpointing", modules=checkpointed, **({"mlps_by_hand": kept} if kept else {}))


#: The checkpoint modes that make a unit's MLP again in the backward.
RECOMPUTES_MLP = ("mlp", "full", "except_attention")


def recomputed_swiglu(module, unit, config: Recompute):
    """The unit's ``mlp`` child where its recomputation is done by hand: a recomputing mode, no
    tiles (the tiled MLP does the same per tile), a SwiGLU of plain linear layers; else None."""
    from weft.strategies.memory.swiglu import is_swiglu

    tiled = config_of(unit.get("shard").params, TiledMlp)
    mlp = getattr(module, "mlp", None)
    if config.checkpoint not in RECOMPUTES_MLP or (tiled is not None and tiled.mlp_tile_tokens) or mlp is None:
        return None
    return mlp if is_swiglu(mlp) else None


def compile_units(model, units, *, plan, inference: bool = False) -> tuple[int, list[str]]:
    """``compile = true``: the unit's children, its attention too where one kernel on the local
    sequence runs it (fused rotary embedding and casts around the kernel; no collectives); not an
    MLP that runs by hand or in tiles (``recompute``, ``tiled_mlp``: their element-wise kernels
    are compiled on their own). Returns the modules compiled, and the units asking
    ``compile_scope = "unit"`` that hold an attention torch cannot trace (compiled child by child)."""
    from weft.plugins.attention import traceable
    from weft.strategies.memory.compile_units import compile_unit

    attention = {m.info.path: traceable(m.get("attention"), m.info.path, plan) for m in plan.modules_for("attention")}
    compiled, children = 0, []
    for unit, config in configured(units, Compile):
        if not config.compile:
            continue
        inside = [flag for path, flag in attention.items() if path.startswith(unit.info.path + ".")]
        traced = bool(inside) and all(inside)
        whole = config.compile_scope == "unit"
        children += [unit.info.path] if whole and not traced else []
        module, params = model.get_submodule(unit.info.path), unit.get("shard").params
        tiled = config_of(params, TiledMlp)
        recompute = config_of(params, Recompute)
        by_hand = (not inference and recompute is not None
                   and recomputed_swiglu(module, unit, recompute) is not None)
        compiled += compile_unit(module, attention=traced,
                                 skip=("mlp",) if by_hand or (tiled is not None and tiled.mlp_tile_tokens > 0) else (),
                                 whole=traced and whole)
    return compiled, children


def compile_lever(model, units, *, plan, ctx) -> None:
    """``compile_units`` as a lever, with what it did in the log."""
    compiled, children = compile_units(model, units, plan=plan, inference=ctx.inference)
    if compiled:
        ctx.log.info("shard.compile", modules=compiled)
    if children:  # compile_scope = "unit" asked, an attention torch cannot trace inside: child by child instead
        ctx.log.warning("shard.compile_scope_children", units=len(children), first=children[0],
                        reason="an attention inside runs collectives or is the vision tower's")


def tiled_mlp(model, units, *, plan, ctx) -> None:
    """``mlp_tile_tokens``: each unit's ``mlp`` child applied in tiles (one TiledMLP per tile size
    and ``compile``: a SwiGLU's element-wise kernels through torch.compile where the unit asks it)."""
    from weft.strategies.memory.tiled_mlp import TiledMLP

    groups: dict[tuple[int, bool], list] = {}
    for unit, config in configured(units, TiledMlp):
        mlp = getattr(model.get_submodule(unit.info.path), "mlp", None)
        compiled = config_of(unit.get("shard").params, Compile)
        if config.mlp_tile_tokens and mlp is not None:
            groups.setdefault((config.mlp_tile_tokens, compiled is not None and compiled.compile), []).append(mlp)
    tiled = sum(TiledMLP(tile_tokens=size, compile=compiled).attach(mlps) for (size, compiled), mlps in groups.items())
    if tiled:
        ctx.log.info("shard.tiled_mlp", modules=tiled)


def offload_activations(model, units, *, plan, ctx) -> None:
    """``offload_activations``: one ActivationOffload over the units, in forward order. None at
    inference (no backward to serve)."""
    offloaded = [] if ctx.inference else [(model.get_submodule(unit.info.path), config.offload_keep_every)
                                          for unit, config in configured(units, Offload) if config.offload_activations]
    from weft.strategies.memory.activation_offload import ActivationOffload

    for every in sorted({n for _, n in offloaded}):  # one per thinning, over its units in forward order
        mine = [module for module, n in offloaded if n == every]
        ActivationOffload(device=ctx.device, keep_every=every).attach(mine)
        ctx.log.info("shard.offload_activations", units=len(mine), keep_every=every)


#: The levers in the order a strategy applies them, before its own sharding.
LEVERS = (cast_storage, float8, freeze, recompute, compile_lever, tiled_mlp, offload_activations)


def apply_levers(model, units, *, plan, ctx) -> None:
    for lever in LEVERS:
        lever(model, units, plan=plan, ctx=ctx)
