"""`weft check`: one batch through the unsharded model and through the recipe's plan; compare.

(a) one process, no parallelism: the model as transformers ships it;
(b) the recipe's plan on N ranks (FSDP, sequence parallelism, the user's plugins).
Both see the same samples (several images of different sizes): data-parallel rank d
takes samples d, d + dp, ...; both apply the same grad_sync (clipping) to the
gradients. Reported: each loss, their relative difference, and the largest
relative gradient difference per parameter group (vision, projector, text,
embedding, head). Users adding a plugin run it to prove their change.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
from typing import Any

import torch

from weft.core.errors import RunFailed
from weft.core.recipe import Recipe

#: Float32 acceptance: what weft's own equivalence tests require.
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def check_batch(recipe: Recipe, *, dp: int, multiple: int) -> list[dict]:
    """``dp`` micro-batches (one per data-parallel rank) of the recipe's first samples."""
    from weft.plugins.models.build import model_config
    from weft.strategies import datasets
    from weft.strategies.conversation import collate, load_processor

    _, processor = model_config(recipe)
    tokenizer, image_processor = load_processor(processor)
    per_rank = 2
    if recipe.data.source == "synthetic":
        source = datasets.synthetic_samples(
            seed=recipe.train.seed, num_samples=per_rank * dp, min_side=recipe.data.min_side,
            max_side=recipe.data.max_side, tokenizer=tokenizer, image_processor=image_processor,
        )
    else:
        path = pathlib.Path(recipe.data.path)
        path = path if path.is_absolute() else pathlib.Path(recipe.source).parent / path
        source = datasets.jsonl_samples(path, processor=processor)
    samples = []
    for sample in source:
        if not isinstance(sample, datasets.BadSample):
            samples.append(sample)
        if len(samples) == per_rank * dp:
            break
    batches = [collate(samples[d::dp], pad_id=tokenizer.pad_token_id, pad_to_multiple_of=multiple) for d in range(dp)]
    text_only = recipe.model.preset is not None and "text" in recipe.model.preset
    return [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "labels")} for b in batches] if text_only else batches


def _groups(model: torch.nn.Module) -> dict[str, str]:
    from weft.plugins.models.inventory import modality_of

    return {name: modality_of(name.rsplit(".", 1)[0]) for name, _ in model.named_parameters()}


def reference(recipe: Recipe, *, dp: int, max_norm: float | None) -> dict:
    """Loss and gradients of the unsharded model on every data-parallel part of the batch."""
    from weft.core.loss import label_count, targets, token_loss_sum
    from weft.plugins.models.build import build_model
    from weft.strategies.grad_norm import clip_global_norm

    model = build_model(recipe, device="cpu", seed=recipe.train.seed)
    batches = check_batch(recipe, dp=dp, multiple=1)
    count = sum(label_count(targets(b)) for b in batches)
    loss = torch.zeros(())
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        part = token_loss_sum(model(**inputs, use_cache=False).logits, targets(batch)) / count
        part.backward()
        loss += part.detach()
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm is not None:
        clip_global_norm(params, max_norm=max_norm)
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, "groups": _groups(model)}


def worker(recipe: Recipe, *, out: pathlib.Path) -> None:
    """One rank of (b); rank 0 writes the loss and the full gradients to ``out``."""
    from weft.core.loop import close_process_group, init_process_group

    rank, world_size, local_rank, device_type = init_process_group(recipe)
    try:
        _one_step(recipe, out=out, rank=rank, world_size=world_size, local_rank=local_rank, device_type=device_type)
    except BaseException:
        close_process_group(clean=False)
        raise
    # The model and its FSDP groups are unreachable once _one_step returns.
    close_process_group(clean=True)


def _one_step(recipe: Recipe, *, out: pathlib.Path, rank: int, world_size: int, local_rank: int, device_type: str) -> None:
    from weft.core.cli import plugin_manager_from_env
    from weft.core.context import RunContext
    from weft.core.logging import run_logger
    from weft.core.loop import StepState, forward_backward, prepare_model
    from weft.core.mesh import device_for
    from weft.plugins.batching import install_sequence_split, shard_batch
    from weft.plugins.models.sp_hooks import vision_tower
    from weft.plugins.models.vision_sync import FLAG, VisionKeepAlive

    pm = plugin_manager_from_env()
    log = run_logger(run_dir=None, rank=rank, console=False)  # the parent prints the comparison
    ctx = RunContext(recipe=recipe, device=device_for(device_type, local_rank), rank=rank, world_size=world_size, log=log)
    model, plan, mesh = prepare_model(recipe=recipe, pm=pm, ctx=ctx)
    split = install_sequence_split(model=model, plan=plan, mesh=mesh) if plan.mesh.sp > 1 else None
    parts = check_batch(recipe, dp=plan.mesh.dp, multiple=split.multiple if split else 1)
    batch = parts[mesh.dp_rank()]
    if plan.mesh.dp > 1 and vision_tower(model) is not None:
        VisionKeepAlive(model)  # as the batching does: all ranks run the tower if any has images
        if "pixel_values" not in batch and any("pixel_values" in p for p in parts):
            batch = dict(batch, **{FLAG: torch.ones((), dtype=torch.bool)})
    state = StepState(step=1)
    forward_backward(model=model, micro_batches=[shard_batch(batch, split) if split else batch], state=state,
                     autocast=torch.autocast("cpu", enabled=False), pm=pm, plan=plan, mesh=mesh, ctx=ctx)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu()
    if rank == 0:
        torch.save({"loss": state.loss, "grads": grads, "mesh": list(plan.mesh.shape)}, out)


def compare(ref: dict, got: dict) -> dict:
    loss_rel = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    by_group: dict[str, float] = {}
    worst_param, worst = "", 0.0
    for name, g_ref in ref["grads"].items():
        g = got["grads"][_fsdp_name(name, got["grads"])]
        rel = ((g - g_ref).abs().max() / g_ref.abs().max().clamp(min=1e-30)).item()
        group = ref["groups"][name]
        by_group[group] = max(by_group.get(group, 0.0), rel)
        if rel >= worst:
            worst_param, worst = name, rel
    return {
        "loss_ref": ref["loss"],
        "loss": got["loss"],
        "loss_rel_diff": loss_rel,
        "grad_max_rel_diff": worst,
        "grad_max_rel_diff_param": worst_param,
        "grad_max_rel_diff_by_group": by_group,
        "ok": loss_rel <= LOSS_TOL and worst <= GRAD_TOL,
        "tolerances": {"loss": LOSS_TOL, "grad": GRAD_TOL},
    }


def _fsdp_name(name: str, names: dict) -> str:
    # FSDP2 keeps parameter names; checkpoint wrappers may add a prefix.
    if name in names:
        return name
    return next(n for n in names if n.endswith(name) or name.endswith(n))


def run_check(recipe: Recipe, *, world_size: int, overrides: list[str], recipe_arg: str, registry: Any) -> dict:
    from weft.core.launch import launch_local
    from weft.core.planner import plan_recipe

    plan, _ = plan_recipe(recipe, registry=registry, world_size=world_size)
    clip = next((d.params.max_norm for d in plan.decisions_of("grad_sync") if d.strategy == "clip"), None)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "sharded.pt"
        args = ["-m", "weft", "_check-worker", recipe_arg, "--out", str(out)]
        for override in overrides:
            args += ["--set", override]
        code = launch_local(nproc=world_size, args=args)
        if code != 0 or not out.is_file():
            raise RunFailed(f"the {world_size}-rank run of `weft check` failed (exit code {code}); its ranks' output above says why", where="weft check")
        got = torch.load(out, weights_only=False)
    ref = reference(recipe, dp=plan.mesh.dp, max_norm=clip)
    result = compare(ref, got)
    # Lower-precision parameters in a rule make a float32 comparison meaningless for that group.
    result["reduced_precision_units"] = sorted(
        m.info.path for m in plan.modules_for("shard") if getattr(m.get("shard").params, "param_dtype", None) not in (None, "float32")
    )
    result.update({"world_size": world_size, "mesh": dict(zip(("dp_replicate", "dp_shard", "ring", "ulysses"), (plan.mesh.dp_replicate, plan.mesh.dp_shard, plan.mesh.ring, plan.mesh.ulysses)))})
    return result


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"mesh {result['mesh']}  world_size={result['world_size']}")
    table = Table(title="unsharded (1 process) vs the recipe's plan")
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("loss (unsharded)", f"{result['loss_ref']:.8f}")
    table.add_row("loss (plan)", f"{result['loss']:.8f}")
    table.add_row("loss relative difference", f"{result['loss_rel_diff']:.2e}")
    table.add_row("largest gradient relative difference", f"{result['grad_max_rel_diff']:.2e} ({result['grad_max_rel_diff_param']})")
    for group, value in sorted(result["grad_max_rel_diff_by_group"].items()):
        table.add_row(f"  {group}", f"{value:.2e}")
    console.print(table)
    console.print(("[green]OK[/green]" if result["ok"] else "[red]DIFFERENT[/red]") + f" (tolerances: loss {LOSS_TOL:g}, gradients {GRAD_TOL:g}, float32)")
    if result["reduced_precision_units"]:
        console.print(f"note: {len(result['reduced_precision_units'])} units compute in a lower param_dtype by rule "
                      f"(e.g. {result['reduced_precision_units'][0]}); their differences are precision, not parallelism")


