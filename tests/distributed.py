"""Run a function on N gloo ranks in fresh processes; a failure on any rank fails the test.

The ranks are forked from a forkserver that has imported torch, transformers and weft once
(``_PRELOAD``), not spawned as fresh interpreters (~5 s of imports each). That server never
starts a process group, changes a default or configures logging: it only imports, so every
call's ranks start from the same state. What a fork would inherit from the server rather than
from this process (the environment, the working directory) is handed to each rank per call.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the forkserver; every rank forks from it. A name missing is skipped by
# multiprocessing (ImportError), so this list only ever saves time.
_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "structlog",
    "transformers", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "weft.core.train.prepare", "weft.core.plan.planner", "weft.core.plugin_manager",
    "weft.core.train.attention_install",
    "weft.core.recipe", "weft.core.mesh", "weft.core.context", "weft.plugins.shard",
    "model_helpers", "distributed",
    # A command's ranks (tests/forked_ranks.py): the command line and the rank jobs' modules.
    "weft.core.commands.main", "weft.core.commands.check", "weft.core.commands.evaluate",
    "weft.core.commands.generate", "weft.core.infer.generate_one", "weft.core.commands.run", "forked_ranks",
]
multiprocessing.set_forkserver_preload(_PRELOAD)


def _entry(rank: int, world: int, store_path: str, env: dict, fn: Callable[..., Any], args: tuple) -> None:
    # The caller's environment, not the forkserver's (a fork inherits the server's, taken when
    # it started). One thread per rank: N ranks share the machine's cores.
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from weft.core.run.process_group import close_process_group

    try:
        fn(rank, world, *args)
    except BaseException:
        close_process_group(clean=False)
        raise
    close_process_group(clean=True)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; raises if any rank raised."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), dict(os.environ), fn, args),
                           nprocs=world, join=True, start_method="forkserver")


def sp_model(recipe_data: dict, *, rank: int, world: int, plugins: tuple[str, ...] = ()):
    """On an initialised gloo group: the recipe's model with weft's attention and sequence split
    installed, plus an untouched copy (transformers' own attention) as the reference.
    ``plugins``: modules to register besides the built-ins (by name: ranks import them).

    Returns (model, reference, plan, mesh, split); split is None without sequence parallelism.
    """
    import copy
    import importlib

    import structlog
    import torch

    from weft.core.context import RunContext
    from weft.core.mesh import build_device_mesh
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.core.train.attention_install import install_attention

    recipe = Recipe.from_dict(recipe_data)
    pm = build_plugin_manager(extra=[(name, importlib.import_module(name)) for name in plugins], entry_points=False)
    family = pm.models.for_recipe(recipe)
    model = family.build(recipe, device="cpu", seed=0)
    reference = copy.deepcopy(model)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=world, model=model)
    mesh = build_device_mesh(plan.mesh, device_type="cpu")
    ctx = RunContext(recipe=recipe, device=torch.device("cpu"), rank=rank, world_size=world, log=structlog.get_logger())
    install_attention(model=model, plan=plan, mesh=mesh, ctx=ctx, pm=pm)
    split = family.sequence_parallel(model, plan=plan, mesh=mesh) if plan.mesh.sp > 1 else None
    return model, reference, plan, mesh, split


def sharded_text_model(shard: dict, *, rank: int, world: int, preset: str = "qwen2_text_tiny"):
    """``preset`` (qwen2_text_tiny) with ``shard`` as its layers' shard rule (applied by the
    built-in shard hook) and ring attention over ``world`` ranks (sdpa on one), in float64;
    (model, split)."""
    import structlog
    import torch

    from weft.core.context import RunContext
    from weft.core.recipe import Recipe
    from weft.plugins.shard import weft_shard

    recipe = {"model": {"preset": preset}, "parallel": {"ring": world},
              "rules": [{"when": {"path": "*.layers.*"}, "shard": shard},
                        {"when": {"modality": "text"}, "attention": {"strategy": "ring" if world > 1 else "sdpa"}}]}
    model, _, plan, mesh, split = sp_model(recipe, rank=rank, world=world)
    ctx = RunContext(recipe=Recipe.from_dict(recipe), device=torch.device("cpu"), rank=rank, world_size=world,
                     log=structlog.get_logger())
    weft_shard(model=model, plan=plan, mesh=mesh, ctx=ctx)
    return model.double(), split
