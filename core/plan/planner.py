"""From a recipe to a Plan: build the model on the meta device, describe it, apply the rules."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weft.core.errors import PlanError
from weft.core.mesh_spec import MeshSpec, resolve_mesh
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import ModuleInfo, Plan, build_plan

if TYPE_CHECKING:
    from weft.core.context import RunContext
    from weft.core.plugin_manager import WeftPluginManager
    from weft.core.registry import Adapters


def plan_recipe(recipe: Recipe, *, pm: WeftPluginManager, world_size: int, model: Any = None) -> tuple[Plan, Any]:
    """The Plan for ``world_size`` ranks; ``model`` defaults to a meta-device build.

    ``pm``: the run's plugin manager (its strategies and model families). Returns
    (plan, model). Raises RecipeError/PlanError before any process group exists.
    """
    family = pm.models.for_recipe(recipe)
    built = model is None
    if built:
        model = family.build(recipe, device="meta", seed=recipe.train.seed)
    modules = family.describe(model)
    where = f"{recipe.source} [parallel]"
    mesh = resolve_mesh(recipe.parallel, world_size=world_size, heads=text_heads(modules), where=where)
    check_heads(modules, mesh, where=where)
    plan = build_plan(recipe=recipe, modules=modules, registry=pm.registry, mesh=mesh, world_size=world_size)
    check_sequence_parallel(plan, pm.registry, where=where)
    check_vision_sharing(plan, family, where=recipe.source)
    check_strategy_params(plan, pm.registry, recipe)
    if built:  # its own meta model: the adapters' errors before any process starts, and what trains
        add_adapters(model, plan=plan, pm=pm, ctx=None)
    return plan, model


def add_adapters(model: Any, *, plan: Plan, pm: WeftPluginManager, ctx: RunContext | None) -> list[Adapters]:
    """``weft_adapter`` (collect-all): each plugin's :class:`weft.core.registry.Adapters`.
    ``ctx`` is None on the planner's own meta model (`weft plan`, the checks before a run)."""
    return pm.adapter(model=model, plan=plan, ctx=ctx)


def text_heads(infos: list[ModuleInfo]) -> int | None:
    """Query heads of the text model's attention (what ulysses='auto' divides)."""
    return next((i.heads for i in infos if i.kind == "attention" and i.modality == "text"), None)


def check_vision_sharing(plan: Plan, family: Any, *, where: str) -> None:
    """A vision strategy that shares one image over the SP ranks needs a tower that allows it."""
    threshold = plan.vision_share_threshold()
    if threshold is None or plan.mesh.sp == 1 or getattr(family, "shares_vision", True):
        return
    module = next(m for m in plan.modules_for("attention") if m.info.modality == "vision")
    decision = module.get("attention")
    raise PlanError(
        f"{module.info.path}: attention strategy {decision.strategy!r} (rule at {decision.source}) shares one image's "
        f"patches over the SP ranks, which model family {family.name!r} does not support; images are still spread "
        "over the ranks with the default vision rule (strategy 'auto')",
        where=where,
    )


def check_strategy_params(plan: Plan, registry: Any, recipe: Recipe) -> None:
    """Each strategy's own plan-time check of its rule parameters against the recipe."""
    seen: set[tuple[str, str, Any]] = set()
    for module in plan.modules:
        for decision in module.decisions:
            strategy = registry.get(decision.point, decision.strategy)
            key = (decision.point, decision.strategy, decision.params)
            if strategy is None or strategy.check is None or key in seen:
                continue
            seen.add(key)
            message = strategy.check(decision.params, recipe=recipe, plan=plan)
            if message:
                raise PlanError(
                    f"{module.info.path or '(root)'}: {decision.point} strategy {_named(decision)} "
                    f"(rule at {decision.source}): {message}",
                    where=recipe.source,
                )


def check_sequence_parallel(plan: Plan, registry: Any, *, where: str) -> None:
    """Text attention must span every sequence-parallel dim the mesh splits the sequence over."""
    split = {dim for dim in ("ulysses", "ring") if getattr(plan.mesh, dim) > 1}
    if not split:
        return
    for module in plan.modules_for("attention"):
        decision = module.get("attention")
        # The strategy that runs: the Plan resolved 'auto' for this module (a vision tower's
        # keeps images whole and splits no heads; text's splits them as the mesh needs).
        strategy = registry.get("attention", decision.strategy)
        head_split = strategy.head_split
        degree = 1
        for dim in head_split:
            degree *= getattr(plan.mesh, dim)
        heads = module.info.heads or 0
        if degree > 1 and heads % degree:
            raise PlanError(
                f"{module.info.path} has {heads} heads, which attention strategy {_named(decision)} "
                f"(rule at {decision.source}) splits over {' x '.join(head_split)} = {degree} ranks; "
                f"the degree must divide the heads",
                where=where,
            )
        if module.info.modality != "text":
            continue
        spans = set(strategy.sp_dims)
        if not split <= spans:
            degrees = ", ".join(f"{d}={getattr(plan.mesh, d)}" for d in sorted(split))
            fitting = [s.name for s in registry.all() if s.point == "attention" and split <= set(s.sp_dims)]
            raise PlanError(
                f"the sequence is split over {degrees}, but {module.info.path} gets attention strategy "
                f"{_named(decision)} (rule at {decision.source}), "
                f"which spans {sorted(spans) or 'no sequence-parallel dims'}; "
                f"strategies that fit: {', '.join(fitting)}",
                where=where,
            )


def _named(decision: Any) -> str:
    """A decision's strategy for messages, with the one its rule named when the Plan resolved it."""
    return repr(decision.strategy) + (f" (resolved from {decision.resolved_from!r})" if decision.resolved_from else "")


def check_heads(modules: list[ModuleInfo], mesh: MeshSpec, *, where: str) -> None:
    """Ulysses splits the text model's heads: query heads must divide evenly.

    KV heads may be fewer than the degree (they are then replicated) but must
    divide it or be divisible by it.
    """
    if mesh.ulysses == 1:
        return
    for info in modules:
        if info.kind != "attention" or info.modality != "text":
            continue
        heads, kv = info.heads or 0, info.kv_heads or 0
        if heads % mesh.ulysses or (kv % mesh.ulysses and mesh.ulysses % kv):
            accepted = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
            raise PlanError(
                f"parallel.ulysses = {mesh.ulysses} does not divide the heads of {info.path} "
                f"({heads} query heads, {kv} KV heads); accepted Ulysses degrees: {', '.join(map(str, accepted))}",
                where=where,
            )
