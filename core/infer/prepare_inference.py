"""A model prepared for inference on one rank (`weft eval`, `weft generate`, `weft eval
--task`): the recipe's plan as training prepares it (core/train/prepare.py), in eval mode, with
a run's checkpoint or a saved adapter directory over the base."""

from __future__ import annotations

import pathlib

from weft.core.checkpoint.read import load_run_weights
from weft.core.context import RunContext
from weft.core.mesh import device_for
from weft.core.plugin_manager import plugin_manager_from_env
from weft.core.recipe import Recipe
from weft.core.run.logging import run_logger
from weft.core.train.prepare import prepare_model


def prepare_inference(recipe: Recipe, *, rank: int, world_size: int, local_rank: int, device_type: str,
                      run_dir: pathlib.Path | None, step: int | None, one_pass: bool = False,
                      adapter_dir: str | None = None) -> tuple:
    """(plugin manager, context, prepared model in eval mode, checkpoint loaded or None): the
    recipe's plan on this rank as training prepares it, with a run's weights when given, or a
    saved adapter directory over the base (``adapter_dir``: the adapter hook loads it)."""
    pm = plugin_manager_from_env()
    log = run_logger(run_dir=None, rank=rank, console=False)  # the parent prints the result
    ctx = RunContext(recipe=recipe, device=device_for(device_type, local_rank), rank=rank, world_size=world_size,
                     log=log, one_pass=one_pass, inference=True,
                     adapter_dir=pathlib.Path(adapter_dir) if adapter_dir else None)
    run = prepare_model(recipe=recipe, pm=pm, ctx=ctx)
    checkpoint = load_run_weights(run.model, run_dir, step) if run_dir is not None else None
    run.model.eval()
    return pm, run.ctx, run, checkpoint
