"""`weft export RUN_DIR OUT_DIR`: the newest checkpoint as a Hugging Face model directory.

One process, whatever world size saved the checkpoint: torch.distributed.checkpoint
reshards the saved shards into the plain model. The directory holds the
safetensors weights and config (``save_pretrained``) plus the processor files,
so ``from_pretrained(OUT_DIR)`` loads it.

The checkpoint is checked first (every file's size and CRC-32 against its manifest, its metadata
plain data: core/checkpoint/read.py), and a damaged one is refused with exit 2 naming the file,
before anything is written. OUT_DIR must be new or empty: a folder that holds anything is
refused (exit 2, naming it and how many entries it holds) unless ``--overwrite`` is given, so
two exports never mix. The export is written to a hidden sibling folder
(``.OUT_DIR.weft-export-PID``) and renamed into place when whole; with ``--overwrite`` the old
folder is renamed aside first and removed only after the new one is in place. A failed export
leaves OUT_DIR as it was.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from weft.core.checkpoint import dcp_read
from weft.core.checkpoint.read import checkpoint_dirs, load_checkpoint_into, refuse_unless_sound, saved_positions
from weft.core.errors import WeftError
from weft.core.recipe import Recipe

if TYPE_CHECKING:
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe.rule_engine import Plan


def run_recipe(run_dir: pathlib.Path) -> Recipe:
    saved = run_dir / "recipe.json"
    if not saved.is_file():
        raise WeftError(f"{run_dir} is not a weft run directory (no recipe.json)", where=str(run_dir))
    data = json.loads(saved.read_text())
    return Recipe.from_dict(data["recipe"], source=data["source"])


def export(run_dir: pathlib.Path, out_dir: pathlib.Path, *, pm: WeftPluginManager, step: int | None = None,
           merge: bool = False, overwrite: bool = False) -> pathlib.Path:
    """A run's checkpoint as a Hugging Face model directory; a run with adapters as the
    adapters' own directory (PEFT's: ``PeftModel.from_pretrained(base, out_dir)``), unless
    ``merge``: then a plain model with the adapters folded into the base's weights.
    ``overwrite``: a non-empty ``out_dir`` is replaced whole instead of refused."""
    _refuse_unwritable(out_dir, run_dir=run_dir, overwrite=overwrite)
    recipe = run_recipe(run_dir)
    family = pm.models.for_recipe(recipe)
    found = checkpoint_dirs(run_dir)
    if step is not None:
        found = [p for p in found if p.name == f"step-{step}"]
    if not found:
        raise WeftError(f"no checkpoint{f' for step {step}' if step is not None else ''} "
                        f"under {run_dir / 'checkpoints'}", where=str(run_dir))
    checkpoint = found[-1]
    refuse_unless_sound(checkpoint)  # before anything is built or written
    final = out_dir.resolve()  # "." and ".." have no name to put a sibling beside
    out_dir = final.with_name(f".{final.name}.weft-export-{os.getpid()}")
    shutil.rmtree(out_dir, ignore_errors=True)  # a leftover of this pid's own failed export
    out_dir.mkdir(parents=True)
    try:
        _export_into(out_dir, checkpoint, family=family, recipe=recipe, pm=pm, merge=merge, run_dir=run_dir)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    _swap_in(out_dir, final)
    return checkpoint


def _export_into(out_dir: pathlib.Path, checkpoint: pathlib.Path, *, family, recipe: Recipe, pm: WeftPluginManager,
                 merge: bool, run_dir: pathlib.Path) -> None:
    started = not dist.is_initialized()
    if started:
        # DCP's loader wants a process group; one rank is enough to reshard any save.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        meta = family.build(recipe, device="meta", seed=recipe.train.seed)
        plan = _rules_plan(meta, recipe, pm=pm)
        adapters = _with_adapters(meta, plan, recipe, pm=pm, merge=merge)
        if adapters and not merge:  # the adapters alone: the base is never built
            _save_adapters(meta, adapters, checkpoint, out_dir, recipe=recipe)
            kind = "adapter directory"
        else:
            # 4-bit units quantised as the run quantised them: merging an adapter into their
            # (dequantised) weights, not into the original ones, gives the model that was trained.
            quantize = plan.quantized_units()
            model = family.build(recipe, device="cpu", seed=recipe.train.seed,
                                  **({"quantize": quantize} if quantize else {}))
            adapters = _with_adapters(model, plan, recipe, pm=pm, merge=merge)
            for path in plan.frozen_units():  # not in the checkpoint: the model as built holds them
                model.get_submodule(path).requires_grad_(False)
            load_checkpoint_into(model, checkpoint, verified=True)
            for added in adapters:  # a plain model, as from_pretrained builds it
                added.merge(model)
            kind = "merged" if adapters else None
    finally:
        if started:
            dist.destroy_process_group()
    if kind != "adapter directory":
        family.export(model, recipe, out_dir, positions=_positions_reached(run_dir, checkpoint))
    (out_dir / "weft_export.json").write_text(json.dumps(
        {"run_dir": str(run_dir), "checkpoint": checkpoint.name, "adapters": kind}, indent=1))


def _refuse_unwritable(out_dir: pathlib.Path, *, run_dir: pathlib.Path, overwrite: bool) -> None:
    """OUT_DIR must be a folder that is new, empty, or (``--overwrite``) one to replace whole."""
    if out_dir.exists() and not out_dir.is_dir():
        raise WeftError(f"{out_dir} is a file, not a folder: weft export writes a model folder there. Name a new or "
                        "empty folder", where="weft export OUT_DIR")
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if held and not overwrite:
        raise WeftError(f"{out_dir} already holds {len(held)} {'entry' if len(held) == 1 else 'entries'} "
                        f"({', '.join(held[:3])}"
                        f"{', ...' if len(held) > 3 else ''}): weft export writes into a new or empty folder, so that "
                        "two exports never mix. Name another folder, or pass --overwrite to replace this one's "
                        "contents whole", where="weft export OUT_DIR")
    if held and run_dir.resolve().is_relative_to(out_dir.resolve()):
        raise WeftError(f"{out_dir} holds the run directory {run_dir}: --overwrite would remove the run itself. "
                        "Name another folder", where="weft export OUT_DIR")


def _swap_in(new: pathlib.Path, final: pathlib.Path) -> None:
    """The finished export renamed to ``final``; an existing ``final`` (empty, or replaced under
    --overwrite) renamed aside first and removed once the new one is in place."""
    old = final.with_name(f".{final.name}.weft-replaced-{os.getpid()}")
    if final.is_dir():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _positions_reached(run_dir: pathlib.Path, checkpoint: pathlib.Path) -> int:
    """How many positions the run's batches had reached when ``checkpoint`` was saved (its
    largest position id + 1, over every segment of a resumed run); for a checkpoint from before
    weft kept it, the run's summary's; 0 where neither knows or no batch was seen."""
    largest = saved_positions(checkpoint)
    if largest >= 0:
        return largest + 1
    try:
        largest = json.loads((run_dir / "summary.json").read_text()).get("largest_position")
    except (OSError, ValueError):
        return 0
    return int(largest) + 1 if isinstance(largest, int) and largest >= 0 else 0


def _save_adapters(meta: torch.nn.Module, adapters: list, checkpoint: pathlib.Path, out_dir: pathlib.Path, *,
                   recipe: Recipe) -> None:
    """The adapters' tensors read from the checkpoint alone (a 72B run's adapters, not its base),
    in the dtypes they were trained in, written by their plugin's ``save`` (the checkpoint
    checked by ``export``)."""
    saved = dcp_read.read_metadata(checkpoint).state_dict_metadata
    params = dict(meta.named_parameters())
    names = [name for added in adapters for name in added.names]
    missing = [n for n in names if f"model.{n}" not in saved]
    if missing:
        raise WeftError(f"checkpoint {checkpoint} lacks {len(missing)} adapter tensors, e.g. {missing[:3]}",
                        where=str(checkpoint))
    tensors = {n: torch.empty(params[n].shape, dtype=saved[f"model.{n}"].properties.dtype) for n in names}
    state = {"model": tensors}
    dcp_read.load(state, checkpoint)
    base = str(recipe.model.path) if recipe.model.path is not None else recipe.model.preset
    for added in adapters:
        added.save(meta, {n: state["model"][n] for n in added.names}, out_dir, base=base)


def _rules_plan(model: torch.nn.Module, recipe: Recipe, *, pm: WeftPluginManager) -> Plan:
    """The run's rules on one process: adapters, frozen and 4-bit units do not depend on the mesh,
    and the run's own mesh may not resolve where export runs."""
    from weft.core.mesh_spec import MeshSpec
    from weft.core.recipe.rule_engine import build_plan

    modules = pm.models.for_recipe(recipe).describe(model)
    return build_plan(recipe=recipe, modules=modules, registry=pm.registry, mesh=MeshSpec(), world_size=1)


def _with_adapters(model: torch.nn.Module, plan: Plan, recipe: Recipe, *, pm: WeftPluginManager, merge: bool) -> list:
    """The run's adapters (its rules' ``weft_adapter``) on the model, so the checkpoint's names
    fit; refused where their plugin cannot write what was asked."""
    from weft.core.plan.planner import add_adapters

    adapters = add_adapters(model, plan=plan, pm=pm, ctx=None)
    if merge and any(added.merge is None for added in adapters):
        raise WeftError("this run's adapters cannot be merged into the base's weights (their plugin gives no "
                        "merge): export them without --merge", where=recipe.source)
    if not merge and any(added.save is None for added in adapters):
        raise WeftError("this run's adapters have no directory format of their own (their plugin gives no save): "
                        "export with --merge for a plain model", where=recipe.source)
    return adapters
