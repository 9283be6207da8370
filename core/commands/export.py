"""`weft export RUN_DIR OUT_DIR`: the newest checkpoint as a Hugging Face model directory.

One process, whatever world size saved the checkpoint: torch.distributed.checkpoint
reshards the saved shards into the plain model. The directory holds the
safetensors weights and config (``save_pretrained``) plus the processor files,
so ``from_pretrained(OUT_DIR)`` loads it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from weft.core.errors import WeftError
from weft.core.recipe import Recipe
from weft.core.run.checkpoint import checkpoint_dirs


def run_recipe(run_dir: pathlib.Path) -> Recipe:
    saved = run_dir / "recipe.json"
    if not saved.is_file():
        raise WeftError(f"{run_dir} is not a weft run directory (no recipe.json)", where=str(run_dir))
    data = json.loads(saved.read_text())
    return Recipe.from_dict(data["recipe"], source=data["source"])


def load_checkpoint_into(model: torch.nn.Module, path: pathlib.Path) -> None:
    """Fill a plain (unsharded) model with a checkpoint's weights, any saving world size, in
    the dtypes they were saved in (a bf16 rule stays bf16 in the export)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, param in model.named_parameters():
        meta = saved.get(f"model.{name}")
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if dtype is not None and dtype != param.dtype:
            param.data = param.data.to(dtype)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])


def export(run_dir: pathlib.Path, out_dir: pathlib.Path, *, pm: Any, step: int | None = None) -> pathlib.Path:
    recipe = run_recipe(run_dir)
    adapter = pm.models.for_recipe(recipe)
    found = checkpoint_dirs(run_dir)
    if step is not None:
        found = [p for p in found if p.name == f"step-{step}"]
    if not found:
        raise WeftError(f"no checkpoint{f' for step {step}' if step is not None else ''} "
                        f"under {run_dir / 'checkpoints'}", where=str(run_dir))
    checkpoint = found[-1]
    started = not dist.is_initialized()
    if started:
        # DCP's loader wants a process group; one rank is enough to reshard any save.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = adapter.build(recipe, device="cpu", seed=recipe.train.seed)
        adapters = _with_adapters(model, recipe, pm=pm)
        load_checkpoint_into(model, checkpoint)
        for added in adapters:  # a plain model, as from_pretrained builds it
            added.merge(model)
    finally:
        if started:
            dist.destroy_process_group()
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter.export(model, recipe, out_dir)
    (out_dir / "weft_export.json").write_text(json.dumps(
        {"run_dir": str(run_dir), "checkpoint": checkpoint.name, "adapters": "merged" if adapters else None}, indent=1))
    return checkpoint


def _with_adapters(model: torch.nn.Module, recipe: Recipe, *, pm: Any) -> list:
    """The run's adapters (its rules' ``weft_adapter``) on the model, so the checkpoint's names
    fit; refused where a plugin's adapters cannot be merged into the base's weights."""
    from weft.core.mesh_spec import MeshSpec
    from weft.core.plan.planner import add_adapters
    from weft.core.recipe.rules import build_plan

    # The rules alone (the adapters' decisions do not depend on the mesh): the run's own mesh
    # may not resolve on the one process export runs in.
    modules = pm.models.for_recipe(recipe).describe(model)
    plan = build_plan(recipe=recipe, modules=modules, registry=pm.registry, mesh=MeshSpec(), world_size=1)
    adapters = add_adapters(model, plan=plan, pm=pm, ctx=None)
    if any(added.merge is None for added in adapters):
        raise WeftError("this run's adapters cannot be merged into the base's weights (their plugin gives no "
                        "merge), so weft export cannot write them as a Hugging Face model", where=recipe.source)
    return adapters
