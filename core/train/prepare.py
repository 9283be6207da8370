"""From a recipe to a model ready to train, in the order torchtitan's parallelize steps
keep: adapter -> model -> Plan -> weft_adapter -> mesh -> weft_shard -> weights (and the
adapters' init) -> weft_attention -> sequence split -> vision keep-alive -> position watch.
Also the process group's life."""

from __future__ import annotations

import datetime
import gc
import os
from typing import Any

import attrs
import torch
import torch.distributed as dist

from weft.core.context import RunContext
from weft.core.mesh import WeftMesh, build_device_mesh
from weft.core.mesh_spec import MESH_ORDER
from weft.core.models import SequenceSplit
from weft.core.plan.planner import add_adapters, plan_recipe
from weft.core.recipe import Recipe
from weft.core.recipe.rules import Plan
from weft.core.train.attention_install import install_attention
from weft.core.train.rope import resolve_rope
from weft.core.train.step import FusedHead
from weft.core.train.weights import materialize_weights


@attrs.frozen(kw_only=True)
class Prepared:
    """A model ready for its first step, with what the step needs beside it."""

    model: torch.nn.Module
    plan: Plan
    mesh: WeftMesh
    split: SequenceSplit | None  # None without sequence parallelism
    keep_vision: bool  # data-parallel ranks run the vision tower together (see core.step)
    fused: FusedHead | None = None  # train.loss = "fused": the loss from the hidden states
    #: The context from here on: the one given, with the model family's adapter and the recipe
    #: as the plan resolved it (a rope rule's rotary keys).
    ctx: RunContext | None = None


def prepare_model(*, recipe: Recipe, pm: Any, ctx: RunContext) -> Prepared:
    adapter = pm.models.for_recipe(recipe)
    ctx = attrs.evolve(ctx, adapter=adapter)
    # Built on the meta device, sharded, then each rank materialises only its shards: read
    # from model.path, or a preset's random init drawn from the seed (the same values on any
    # world size and device). No process ever holds the whole model.
    model = adapter.build(recipe, device="meta", seed=recipe.train.seed)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=ctx.world_size, model=model)
    resolved = resolve_rope(recipe, plan=plan, pm=pm)
    if resolved is not recipe:  # a rope rule: the same modules, built with its rotary keys
        recipe = resolved
        ctx = attrs.evolve(ctx, recipe=recipe)
        model = adapter.build(recipe, device="meta", seed=recipe.train.seed)
        ctx.log.info("rope.rule", scaling=recipe.model.rope_scaling, factor=recipe.model.rope_factor)
    # Adapters (LoRA) on the model as built, before sharding: FSDP2 shards them with their
    # layers, checkpointing and compile see them, the optimizer gets only them.
    adapters = add_adapters(model, plan=plan, pm=pm, ctx=ctx)
    mesh = build_device_mesh(plan.mesh, device_type=ctx.device.type)
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None  # for weft report's MFU
    ctx.log.info("run.start", world_size=ctx.world_size, mesh=dict(zip(MESH_ORDER, plan.mesh.shape)),
                 model=adapter.name, params=sum(p.numel() for p in model.parameters()), device=str(ctx.device),
                 gpu=gpu)
    pm.call_all("weft_shard", model=model, plan=plan, mesh=mesh, ctx=ctx)
    # (a shard strategy may have materialised it already: 4-bit units under FSDP2)
    materialize_weights(model, adapter=adapter, recipe=recipe, plan=plan, device=ctx.device, log=ctx.log)
    for added in adapters:  # after the base's weights: the adapters are not in its checkpoint
        added.init(model, seed=recipe.train.seed)
    install_attention(model=model, plan=plan, mesh=mesh, ctx=ctx, pm=pm)
    # The position watch goes first on the text decoder, so it sees whole-sequence ids.
    ctx.state.positions = adapter.watch_positions(model, recipe=recipe, log=ctx.log)
    split = adapter.sequence_parallel(model, plan=plan, mesh=mesh) if plan.mesh.sp > 1 else None
    keep_vision = plan.mesh.dp > 1 and adapter.vision_tower(model) is not None
    if keep_vision:
        adapter.keep_vision_alive(model)
    fused = FusedHead(model=model, decoder=adapter.text_decoder(model)) if recipe.train.loss == "fused" else None
    model.train()
    return Prepared(model=model, plan=plan, mesh=mesh, split=split, keep_vision=keep_vision, fused=fused, ctx=ctx)


def device_type_for(recipe: Recipe) -> str:
    """``parallel.device``: cuda, cpu, or (auto) cuda where a GPU is present."""
    want = recipe.parallel.device
    return "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"


def use_expandable_segments() -> None:
    """The CUDA caching allocator grows segments instead of fragmenting, unless the user's
    own ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise. Set in the allocator itself, not only
    in the environment: the environment is read once, when CUDA starts, and an import may
    start it before this runs (transformers imports torchao where it is installed, which
    queries the GPU): the 32K recipe then ran out of memory at step 2 in three runs of
    three with 11.5 GiB reserved but unallocated (BENCHMARKS.md, issue 25)."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # processes this one starts
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")


def init_process_group(recipe: Recipe) -> tuple[int, int, int, str, Any]:
    """(rank, world_size, local_rank, device_type, store); a single process gets a one-rank
    group. ``store``: the rendezvous store the ranks share (heartbeats: core/run/peer_watch.py)."""
    device_type = device_type_for(recipe)
    if device_type == "cuda" and recipe.parallel.expandable_segments:
        use_expandable_segments()
    backend = recipe.parallel.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ:  # started by torchrun / the elastic launcher
            timeout = datetime.timedelta(minutes=10)
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            # A restarted round may share the launcher's store with the round that failed: a
            # prefix per attempt keeps its ranks from reading the dead ranks' addresses.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"weft/attempt_{attempt}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    else:  # already initialised by an embedding program: its store, which torch keeps
        store = dist.distributed_c10d._get_default_store()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return dist.get_rank(), dist.get_world_size(), local_rank, device_type, store


def close_process_group(*, clean: bool) -> None:
    """Tear every process group down while the interpreter is still whole.

    ``clean``: this rank finished without an error, so every rank reaches this point;
    a barrier first keeps a fast rank from closing connections a slower peer's last
    collective still uses. After an error a one-rank group is still destroyed (a
    library caller may start another run); a multi-rank one is left alone, since the
    peers may never arrive and the launcher stops them.

    Models wrapped by FSDP and device meshes sit in reference cycles that hold
    sub-groups (and their Gloo work threads); left to the collector at interpreter
    exit, they are destroyed while modules are being cleared, which aborts the
    process now and then ("terminate called without an active exception"; seen once
    in about a hundred two-rank `weft check` runs on two busy cores). Collecting them
    here, before destroying the groups, avoids that.
    """
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        if not clean:
            return
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
