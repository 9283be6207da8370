"""`weft check`: one step through the recipe's plan on N ranks and through the unsharded
model on the same micro-batches; compare.

(a) the recipe's plan on N ranks: FSDP, sequence parallelism, the user's plugins, the
    first step's micro-batches from the recipe's own batching strategy (``weft_batching``,
    so third-party batching is checked too), cut by the core as in a run;
(b) one process, the model as transformers ships it, on exactly those micro-batches
    (every data-parallel rank's), same initial weights, same device kind.
Compared: the losses; every gradient before ``weft_grad_sync`` (clipping would hide a
uniform scale error); the global gradient norm the grad-sync strategy measured; and,
where every grad-sync strategy says what it leaves (its record's ``reference``: the built-in
``clip``'s clipped gradients), the gradients after grad sync. Worst relative difference per
parameter group (vision, projector, text, embedding, head). TF32 is off on both sides.
"""

from __future__ import annotations

import pathlib
import tempfile
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weft.core.errors import WeftError
from weft.core.recipe import Recipe
from weft.core.run.rank_job import launch_ranks

if TYPE_CHECKING:
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe.rule_engine import Plan

#: Float32 acceptance: what weft's own equivalence tests require.
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
#: bf16: a plan's difference from the float32 reference may be this many times the unsharded
#: model's own in bf16 (its "floor").
BF16_FACTOR = 2.0
#: bf16: the least loss tolerance. The loss is one number, so its floor is one sample of the
#: bf16 rounding's error, and a mean over a thousand tokens can cancel to 1e-6 by chance (the
#: tiny VL's seeds 0..3: floors 1.3e-6 to 3.4e-5, ring 2 at 4e-6 to 3.7e-5); 1e-4 is still 40
#: times below bf16's unit roundoff, and a plan that is wrong shows in its gradients as well.
BF16_LOSS_TOL = 1e-4


def _exact_matmuls() -> None:
    # cuDNN convolutions and CUDA matmuls may use TF32 in float32 by default: both
    # sides compute in true float32, so a difference is the plan's, not the kernels'.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _full(grad: torch.Tensor) -> torch.Tensor:
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().float().cpu()


def few_synthetic_samples(recipe: Recipe, *, world_size: int) -> Recipe:
    """One step needs a few samples, not the recipe's whole synthetic set (512 conversations
    with images take seconds per rank to make): the batching draws its first step from the
    first max(64, 32 x world size). The computation checked is the same; which samples the
    first step holds may differ from a run's. Data from a file is read as it is."""
    import attrs

    if recipe.data.source != "synthetic":
        return recipe
    fewer = min(recipe.data.num_samples, max(64, 32 * world_size))
    return attrs.evolve(recipe, data=attrs.evolve(recipe.data, num_samples=fewer))


def worker(recipe: Recipe, *, out: pathlib.Path) -> None:
    """One rank of (a), as eval's and generate's ranks run (core/run/rank_job.py); rank 0 writes the
    loss and the full gradients to ``out``, the first SP rank of each data-parallel group its
    whole micro-batches beside it. The model and its FSDP groups are unreachable once the step
    returns, before the process group closes."""
    from weft.core.run.rank_job import run_on_rank

    run_on_rank(recipe, out=out, job=_one_step, target=out)


def _one_step(recipe: Recipe, *, target: pathlib.Path, rank: int, world_size: int, local_rank: int,
              device_type: str) -> None:
    from weft.core.context import RunContext, StepState
    from weft.core.mesh import device_for
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.run.logging import run_logger
    from weft.core.train.prepare import prepare_model
    from weft.core.train.step import autocast_for, finish_step, run_micro_batches

    _exact_matmuls()
    recipe = few_synthetic_samples(recipe, world_size=world_size)
    pm = plugin_manager_from_env()
    log = run_logger(run_dir=None, rank=rank, console=False)  # the parent prints the comparison
    ctx = RunContext(recipe=recipe, device=device_for(device_type, local_rank), rank=rank, world_size=world_size,
                     log=log)
    run = prepare_model(recipe=recipe, pm=pm, ctx=ctx)
    ctx, recipe = run.ctx, run.ctx.recipe
    decision = run.plan.decision("batching")
    steps = pm.batching(decision=decision, recipe=recipe, plan=run.plan, mesh=run.mesh, model=run.model, ctx=ctx)
    micro_batches = next(iter(steps))
    if run.mesh.sp.get_local_rank() == 0:
        torch.save(micro_batches, target.with_name(f"batches-dp{run.mesh.dp_rank()}.pt"))
    autocast = autocast_for(recipe.train.precision, device_type)
    loss_sum, totals = run_micro_batches(model=run.model, micro_batches=micro_batches, split=run.split,
                                         keep_vision=run.keep_vision, autocast=autocast, ctx=ctx, fused=run.fused,
                                         objective=run.objective)
    before = {}
    for name, p in run.model.named_parameters():
        if p.grad is not None:
            grad = p.grad
            if not hasattr(grad, "full_tensor") and world_size > 1:
                # A parameter no FSDP unit owns: its rank-local gradients are averaged by grad sync.
                grad = grad.detach().clone()
                dist.all_reduce(grad)
                grad /= world_size
            before[name] = _full(grad)
    state = StepState(step=1)
    finish_step(pm=pm, model=run.model, plan=run.plan, mesh=run.mesh, ctx=ctx, state=state, loss_sum=loss_sum,
                totals=totals)
    after = {name: _full(p.grad) for name, p in run.model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save({"loss": state.loss, "grad_norm": state.grad_norm, "grads": before, "clipped": after}, target)


def _after_sync(sync: list) -> Any:
    """``after(grads, norm)``: the gradients the grad-sync strategies leave, each record's
    ``reference`` in the order of the rules (the norm measured again after each)."""

    def after(grads: dict, norm: float) -> dict:
        for record, params in sync:
            grads = record.reference(params, grads=grads, norm=norm)
            norm = torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt().item()
        return grads

    return after


def reference(recipe: Recipe, *, family: Any, batches: list[dict], device: str, after_sync: Any = None,
              precisions: tuple[str, ...] = ("fp32",), frozen: tuple[str, ...] = (), plan: Plan | None = None,
              pm: WeftPluginManager | None = None) -> dict[str, dict]:
    """Loss and gradients of the unsharded model on every rank's micro-batches, in each of
    ``precisions`` (float32, bf16 autocast): one model, built once, its gradients cleared between.
    ``after_sync(grads, norm)``: the gradients after grad sync (``clipped``); None: unchanged.
    ``frozen``: module paths whose parameters take no gradient (the plan's frozen units);
    ``plan`` and ``pm``: the ranks' adapters (``weft_adapter``), added and drawn alike, and their
    quantised units, quantised alike."""
    from weft.core.train.loss import targets
    from weft.core.train.step import NextToken, autocast_for, shard_micro_batch

    _exact_matmuls()
    quantize = plan.quantized_units() if plan is not None else {}  # the ranks' 4-bit units, the same codes
    model = family.build(recipe, device=device, seed=recipe.train.seed, **({"quantize": quantize} if quantize else {}))
    objective = NextToken()
    if plan is not None and pm is not None:
        from weft.core.context import RunContext
        from weft.core.plan.planner import add_adapters
        from weft.core.run.logging import run_logger

        log = run_logger(run_dir=None, rank=0, console=False)
        ctx = RunContext(recipe=recipe, device=torch.device(device), log=log)
        for added in add_adapters(model, plan=plan, pm=pm, ctx=ctx):
            added.init(model, seed=recipe.train.seed)
        # The ranks' objective, on one process: its sums over whole sequences need no group.
        objective = pm.objective(decision=plan.decision("objective"), plan=plan, mesh=None, ctx=ctx)
    for path in frozen:
        model.get_submodule(path).requires_grad_(False)
    keys = (*objective.token_keys, *objective.batch_keys)
    local = [shard_micro_batch(b, None, token_keys=objective.token_keys) for b in batches]
    count = sum(float(objective.units(b, targets(b))) for b in local)
    results = {}
    for precision in precisions:
        model.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)
        for batch in local:
            inputs = {k: v.to(device) for k, v in batch.items() if k not in ("labels", "shift_labels", *keys)}
            extra = {k: batch[k].to(device) for k in keys if k in batch}
            with autocast_for(precision, device):
                part = objective.loss_sum(model=model, batch=inputs, target=targets(batch).to(device), fused=None,
                                          extra=extra) / count
            part.backward()
            loss += part.detach()
        grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        norm = torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt().item()
        groups = {name: family.modality_of(name.rsplit(".", 1)[0]) for name in grads}
        results[precision] = {"loss": loss.item(), "grads": grads, "grad_norm": norm, "groups": groups,
                              "clipped": after_sync(grads, norm) if after_sync is not None else grads}
    return results


def _worst(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
           groups: dict[str, str]) -> tuple[dict, str, float]:
    by_group: dict[str, float] = {}
    worst_param, worst = "", 0.0
    for name, g_ref in ref.items():
        g = got[_fsdp_name(name, got)]
        rel = ((g - g_ref).abs().max() / g_ref.abs().max().clamp(min=1e-30)).item()
        by_group[groups[name]] = max(by_group.get(groups[name], 0.0), rel)
        if rel >= worst:
            worst_param, worst = name, rel
    return by_group, worst_param, worst


def compare(ref: dict, got: dict, *, floor: dict | None = None) -> dict:
    """``got`` against ``ref``; with ``floor`` (bf16: the unsharded model's own bf16 result
    against the float32 reference), each difference may reach ``BF16_FACTOR`` times the
    floor's instead of the float32 tolerances: a parallel plan is as exact as the unsharded
    model in the same precision, not more."""
    loss_rel = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
    by_group, worst_param, worst = _worst(ref["grads"], got["grads"], ref["groups"])
    norm_rel = None
    if got.get("grad_norm") is not None:
        norm_rel = abs(got["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-30)
    clipped = None
    if ref.get("compare_clipped"):
        clipped = _worst(ref["clipped"], got["clipped"], ref["groups"])[2]
    loss_tol, grad_tol = LOSS_TOL, GRAD_TOL
    if floor is not None:
        loss_tol = max(BF16_LOSS_TOL, BF16_FACTOR * floor["loss_rel_diff"])
        grad_tol = max(GRAD_TOL, BF16_FACTOR * floor["grad_max_rel_diff"])
    ok = loss_rel <= loss_tol and worst <= grad_tol and (norm_rel is None or norm_rel <= grad_tol)
    ok = ok and (clipped is None or clipped <= grad_tol)
    # The same parameters take gradients on both sides (a frozen unit's take none on either).
    ok = ok and len(got["grads"]) == len(ref["grads"])
    return {
        "loss_ref": ref["loss"],
        "loss": got["loss"],
        "loss_rel_diff": loss_rel,
        "grad_max_rel_diff": worst,
        "grad_max_rel_diff_param": worst_param,
        "grad_max_rel_diff_by_group": by_group,
        "grad_norm_ref": ref["grad_norm"],
        "grad_norm": got.get("grad_norm"),
        "grad_norm_rel_diff": norm_rel,
        "clipped_grad_max_rel_diff": clipped,
        "grad_params": {"reference": len(ref["grads"]), "plan": len(got["grads"])},
        "ok": ok,
        "tolerances": {"loss": loss_tol, "grad": grad_tol},
        **({"bf16_floor": {k: floor[k] for k in ("loss_rel_diff", "grad_max_rel_diff")}} if floor else {}),
    }


def _fsdp_name(name: str, names: dict) -> str:
    # FSDP2 keeps parameter names; checkpoint wrappers may add a prefix.
    if name in names:
        return name
    return next(n for n in names if n.endswith(name) or name.endswith(n))


def run_check(recipe: Recipe, *, world_size: int, overrides: list[str], recipe_arg: str, pm: WeftPluginManager) -> dict:
    from weft.core.mesh_spec import MESH_ORDER
    from weft.core.plan.planner import plan_recipe

    plan, _ = plan_recipe(recipe, pm=pm, world_size=world_size)
    from weft.core.train.rope_resolve import resolve_rope

    recipe = resolve_rope(recipe, plan=plan, pm=pm)  # the reference gets the ranks' rotary scaling
    if plan.packed():
        raise WeftError("weft check compares unpacked micro-batches; set pack = false in the batching rule to check "
                        "this plan's parallelism (packed attention has its own tests)", where=f"{recipe.source} (pack)")
    sync = [(plan.strategy(d), d.params) for d in plan.decisions_of("grad_sync")]
    # After grad sync: known where every strategy says what it leaves of the gradients, in order.
    known = bool(sync) and all(record is not None and record.reference is not None for record, _ in sync)
    after_sync = _after_sync(sync) if known else None
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "sharded.pt"
        launch_ranks("check", nproc=world_size, out=out,
                     args=[recipe_arg, *(arg for override in overrides for arg in ("--set", override))])
        got = torch.load(out, weights_only=True)  # written by our own ranks; still only tensors and numbers
        batches = [mb for d in range(plan.mesh.dp)
                   for mb in torch.load(out.with_name(f"batches-dp{d}.pt"), weights_only=True)]
    from weft.core.run.process_group import device_type_for

    # bf16: the unsharded model's own bf16 difference from float32 is the yardstick.
    precisions = ("fp32", "bf16") if recipe.train.precision == "bf16" else ("fp32",)
    refs = reference(recipe, family=pm.models.for_recipe(recipe), batches=batches, after_sync=after_sync,
                     device=device_type_for(recipe), precisions=precisions, frozen=tuple(plan.frozen_units()),
                     plan=plan, pm=pm)
    ref = refs["fp32"]
    floor = compare(ref, refs["bf16"]) if "bf16" in refs else None
    ref["compare_clipped"] = known
    result = compare(ref, got, floor=floor)
    result["precision"] = recipe.train.precision
    # Lower-precision parameters in a rule make a float32 comparison meaningless for that group.
    result["reduced_precision_units"] = sorted(
        m.info.path for m in plan.modules_for("shard")
        if any(getattr(m.get("shard").params, key, None) not in (None, "float32")
               for key in ("param_dtype", "storage_dtype"))
    )
    result.update({"world_size": world_size, "mesh": dict(zip(MESH_ORDER, plan.mesh.shape)),
                   "micro_batches": len(batches), "frozen_units": plan.frozen_units()})
    return result
