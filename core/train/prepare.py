"""From a recipe to a model ready to train, in the order torchtitan's parallelize steps
keep: family -> model -> Plan -> weft_adapter -> mesh -> weft_shard -> weights (and the
adapters' init) -> weft_attention -> sequence split -> vision keep-alive -> position watch.
The process group the model lives in is set up before this (core/run/process_group.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from weft.core.context import RunContext
from weft.core.mesh import WeftMesh, build_device_mesh
from weft.core.mesh_spec import MESH_ORDER
from weft.core.models import SequenceSplit
from weft.core.plan.planner import add_adapters, plan_recipe
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import Plan
from weft.core.registry import Objective
from weft.core.train.attention_install import install_attention
from weft.core.train.rope_resolve import resolve_rope
from weft.core.train.step import FusedHead
from weft.core.train.weights import materialize_weights

if TYPE_CHECKING:
    from weft.core.plugin_manager import WeftPluginManager


@attrs.frozen(kw_only=True)
class Prepared:
    """A model ready for its first step, with what the step needs beside it."""

    model: torch.nn.Module
    plan: Plan
    mesh: WeftMesh
    split: SequenceSplit | None  # None without sequence parallelism
    keep_vision: bool  # data-parallel ranks run the vision tower together (see core.step)
    fused: FusedHead | None = None  # train.loss = "fused": the loss from the hidden states
    objective: Objective | None = None  # weft_objective's; None: the next-token loss
    #: The context from here on: the one given, with the model family and the recipe
    #: as the plan resolved it (a rope rule's rotary keys).
    ctx: RunContext | None = None


def prepare_model(*, recipe: Recipe, pm: WeftPluginManager, ctx: RunContext) -> Prepared:
    family = pm.models.for_recipe(recipe)
    ctx = attrs.evolve(ctx, family=family)
    # Built on the meta device, sharded, then each rank materialises only its shards: read
    # from model.path, or a preset's random init drawn from the seed (the same values on any
    # world size and device). No process ever holds the whole model.
    model = family.build(recipe, device="meta", seed=recipe.train.seed)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=ctx.world_size, model=model)
    resolved = resolve_rope(recipe, plan=plan, pm=pm)
    if resolved is not recipe:  # a rope rule: the same modules, built with its rotary keys
        recipe = resolved
        ctx = attrs.evolve(ctx, recipe=recipe)
        model = family.build(recipe, device="meta", seed=recipe.train.seed)
        ctx.log.info("rope.rule", scaling=recipe.model.rope_scaling, factor=recipe.model.rope_factor)
    # Adapters (LoRA) on the model as built, before sharding: FSDP2 shards them with their
    # layers, checkpointing and compile see them, the optimizer gets only them.
    adapters = add_adapters(model, plan=plan, pm=pm, ctx=ctx)
    mesh = build_device_mesh(plan.mesh, device_type=ctx.device.type)
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None  # for weft report's MFU
    ctx.log.info("run.start", world_size=ctx.world_size, mesh=dict(zip(MESH_ORDER, plan.mesh.shape)),
                 model=family.name, params=sum(p.numel() for p in model.parameters()), device=str(ctx.device),
                 gpu=gpu)
    pm.shard(model=model, plan=plan, mesh=mesh, ctx=ctx)
    # (a shard strategy may have materialised it already: 4-bit units under FSDP2)
    materialize_weights(model, family=family, recipe=recipe, plan=plan, device=ctx.device, log=ctx.log)
    for added in adapters:  # after the base's weights: the adapters are not in its checkpoint
        added.init(model, seed=recipe.train.seed)
    install_attention(model=model, plan=plan, mesh=mesh, ctx=ctx, pm=pm)
    # The position watch goes first on the text decoder, so it sees whole-sequence ids.
    ctx.state.positions = family.watch_positions(model, recipe=recipe, log=ctx.log)
    split = family.sequence_parallel(model, plan=plan, mesh=mesh) if plan.mesh.sp > 1 else None
    keep_vision = plan.mesh.dp > 1 and family.vision_tower(model) is not None
    if keep_vision:
        family.keep_vision_alive(model)
    fused = FusedHead(model=model, decoder=family.text_decoder(model)) if recipe.train.loss == "fused" else None
    objective = pm.objective(decision=plan.decision("objective"), plan=plan, mesh=mesh, ctx=ctx)
    model.train()
    return Prepared(model=model, plan=plan, mesh=mesh, split=split, keep_vision=keep_vision, fused=fused,
                    objective=objective, ctx=ctx)
