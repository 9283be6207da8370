"""The run's optimizer and learning-rate schedule: parameter groups from the Plan, the
optimizer from the ``weft_optimizer`` hook, the warmup + cosine schedule from ``[train]``.

Each trainable parameter belongs to the ``optimizer`` decision of the innermost shard
unit that holds it, else of the module that holds it directly (kind ``params``: a patch
embedding, a final norm), else the root's: one parameter group per decision, with the
rule's ``lr`` (else ``train.lr``) times its ``lr_scale`` and its ``weight_decay`` (else
``train.weight_decay``). The strategies themselves live in plugins/optimizer.py.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from weft.core.registry import OptimizerGroup

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import Plan


def optimizer_groups(model: torch.nn.Module, plan: Plan, recipe: Recipe) -> list[OptimizerGroup]:
    """The trainable parameters split by their module's optimizer decision, in module order."""
    owner: dict[int, tuple[Any, str]] = {}
    root = plan.root().get("optimizer")
    owners = [m for m in plan.modules if m.info.kind in ("unit", "params") and m.get("optimizer") is not None]
    for unit in sorted(owners, key=lambda u: u.info.path.count(".")):  # deeper modules overwrite shallower ones
        module = model.get_submodule(unit.info.path)
        for p in module.parameters(recurse=unit.info.kind == "unit"):  # "params": its own, outside every unit
            owner[id(p)] = (unit.get("optimizer"), unit.info.path)
    grouped: dict[Any, tuple[list, list]] = {}
    for p in model.parameters():
        if not p.requires_grad:  # frozen units (trainable = false): no group, no state
            continue
        decision, path = owner.get(id(p), (root, ""))
        params, paths = grouped.setdefault(decision, ([], []))
        params.append(p)
        if path not in paths:
            paths.append(path)
    train = recipe.train
    groups = []
    for decision, (params, paths) in grouped.items():
        settings = decision.params
        lr = getattr(settings, "lr", None)
        decay = getattr(settings, "weight_decay", None)
        groups.append(OptimizerGroup(decision=decision, params=tuple(params), modules=tuple(paths),
                                     lr=(train.lr if lr is None else lr) * getattr(settings, "lr_scale", 1.0),
                                     weight_decay=train.weight_decay if decay is None else decay))
    return groups


def make_optimizer(recipe: Recipe, model: torch.nn.Module, *, plan: Plan, pm: WeftPluginManager,
                   ctx: RunContext) -> tuple[Any, Any]:
    """The optimizer the plan's ``optimizer`` decisions name, and the schedule of ``[train]``."""
    groups = optimizer_groups(model, plan, recipe)
    decision = groups[0].decision if groups else plan.root().get("optimizer")
    optimizer = pm.optimizer(decision=decision, groups=groups, recipe=recipe, ctx=ctx)
    for torch_group, group in zip(optimizer.param_groups, groups):
        torch_group.setdefault("rule", f"{group.decision.rule} ({group.decision.source})")  # what guards name
    if ctx.log is not None:
        if recipe.warmup_warning(steps=recipe.train.max_steps) is not None:  # a schedule that never peaks
            last = round(lr_lambda(recipe)(recipe.train.max_steps - 1), 6)  # of train.lr, at the last step
            ctx.log.warning("schedule.warmup_past_end", warmup_steps=recipe.train.warmup_steps,
                            steps=recipe.train.max_steps, last_lr_factor=last,
                            advice="set train.warmup_steps below the run's steps")
        for group in groups:
            ctx.log.info("optimizer.group", strategy=group.decision.strategy, rule=group.decision.source,
                         lr=group.lr, weight_decay=group.weight_decay, tensors=len(group.params),
                         parameters=sum(p.numel() for p in group.params), modules=len(group.modules))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(recipe))


#: torch's warning when a schedule advances before the optimizer's first step.
_EARLY_SCHEDULE = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def advance_schedule(scheduler: Any, *, skipped: bool) -> None:
    """One step along ``[train]``'s schedule, whether the optimizer stepped or a guard skipped it.

    A skipped step uses up its place: step n trains at the schedule's value for n whatever was
    skipped before it, so the schedule ends at ``max_steps`` as the recipe says (docs/faults.md).
    torch warns when a schedule advances before any optimizer step, to catch a loop that calls
    the two in the wrong order; a run whose first steps were skipped is not that mistake, so on
    a skipped step that one warning is ignored, in this call only."""
    if not skipped:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EARLY_SCHEDULE, category=UserWarning)
        scheduler.step()


def lr_lambda(recipe: Any):
    warmup, total, floor = recipe.train.warmup_steps, recipe.train.max_steps, recipe.train.min_lr_ratio

    def factor(step: int) -> float:
        # step counts completed optimizer steps: 0 for the first step.
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def state_gib(model: torch.nn.Module, optimizer: Any) -> dict[str, float]:
    """This rank's bytes (GiB) of weights, gradients and optimizer states, as they stand:
    read after a backward and an optimizer step, it shows what frozen units and sharding
    save. A DTensor counts its local shard; a tensor subclass that stores other tensors (a 4-bit
    weight, 8-bit optimizer states) counts those."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        if hasattr(type(t), "__tensor_flatten__"):
            inner, _ = t.__tensor_flatten__()
            return sum(local(getattr(t, name)) for name in inner)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"weights": sum(local(p) for p in params) / 2**30,
            "gradients": sum(local(p.grad) for p in params if p.grad is not None) / 2**30,
            "optimizer": sum(local(v) for v in states) / 2**30,
            "trainable_params": sum(p.numel() for p in params if p.requires_grad)}
