"""The rule engine: match modules against ordered rules and freeze the result as a Plan.

Pure: imports no torch. The same recipe, module inventory and world size give the
same Plan on every rank. First matching rule per hook point wins; the recipe's own
rules come first, then included files in order, then weft's defaults.
"""

from __future__ import annotations

import fnmatch
import operator
from typing import Any, Iterable

import attrs

from weft.core.errors import PlanError, RecipeError
from weft.core.hookspecs import HOOK_POINTS, MULTI_POINTS
from weft.core.mesh_spec import MeshSpec
from weft.core.recipe import Recipe
from weft.core.recipe.convert import build, did_you_mean
from weft.core.recipe.syntax import RUN_STRATEGY, Action, Rule, Selector, default_rules
from weft.core.registry import Strategy, StrategyRegistry

#: Which kind of module each hook point decides for.
POINT_KINDS: dict[str, tuple[str, ...]] = {
    "rope": ("attention",),
    "adapter": ("attention", "unit", "params", "root"),
    "shard": ("unit", "root"),
    "attention": ("attention",),
    "kv_cache": ("attention",),
    "batching": ("root",), "objective": ("root",),
    "grad_sync": ("root",),
    "guard": ("root",),
    "optimizer": ("unit", "params", "root"),
    "metrics": ("root",),
}

_OPS = {"eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "ge": operator.ge, "lt": operator.lt,
        "le": operator.le}


@attrs.frozen(kw_only=True)
class ModuleInfo:
    """What the rules can see of one module; made by a model family."""

    path: str  # "" is the root
    class_name: str
    kind: str  # "attention", "unit" (a shard unit), "params" (own parameters outside every unit) or "root"
    modality: str | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None


@attrs.frozen(kw_only=True)
class Decision:
    point: str
    strategy: str
    params: Any
    source: str  # "file:line" of the deciding rule
    rule: str
    #: The strategy the rule named when the Plan resolved it to ``strategy`` (attention
    #: ``auto``); "" when it runs as named. Shown by `weft plan --explain`.
    resolved_from: str = ""

    def to_json(self) -> dict:
        data = {"strategy": self.strategy, "params": attrs.asdict(self.params), "rule": self.rule,
                "source": self.source}
        return data | ({"resolved_from": self.resolved_from} if self.resolved_from else {})


@attrs.frozen(kw_only=True)
class ModulePlan:
    info: ModuleInfo
    decisions: tuple[Decision, ...]

    def get(self, point: str) -> Decision | None:
        return next((d for d in self.decisions if d.point == point), None)


@attrs.frozen(kw_only=True)
class Plan:
    modules: tuple[ModulePlan, ...]
    mesh: MeshSpec
    seq_len: int
    world_size: int
    #: The strategies the rules were validated against: the core reads a decision's record, not its name.
    registry: StrategyRegistry | None = attrs.field(default=None, eq=False, repr=False)

    def root(self) -> ModulePlan:
        return next(m for m in self.modules if m.info.kind == "root")

    def modality_of(self, path: str) -> str | None:
        """The declared modality of the module at ``path`` (None for the root or an unknown path)."""
        return next((m.info.modality for m in self.modules if m.info.path == path), None)

    def decision(self, point: str) -> Decision:
        """The single global decision of a root-level point (batching)."""
        decisions = self.decisions_of(point)
        return decisions[0]

    def decisions_of(self, point: str) -> tuple[Decision, ...]:
        return tuple(d for d in self.root().decisions if d.point == point)

    def strategy(self, decision: Decision) -> Strategy | None:
        """The record of the strategy ``decision`` names (None: not registered, or no registry)."""
        return self.registry.get(decision.point, decision.strategy) if self.registry is not None else None

    def adapted(self) -> list[ModulePlan]:
        """The modules whose adapter decision adds something (its strategy is not inert)."""
        return [m for m in self.modules_for("adapter")
                if (record := self.strategy(m.get("adapter"))) is not None and not record.inert]

    def packed(self) -> bool:
        """Batching packs several documents into one row (its ``pack`` parameter)."""
        return bool(getattr(self.decision("batching").params, "pack", False))

    def sequence_layout(self) -> str:
        """How the text sequence is split over the ring ranks: the ``layout`` parameter of
        the text attention's strategy when the ring has more than one rank, else contiguous."""
        if self.mesh.ring == 1:
            return "contiguous"
        module = next((m for m in self.modules_for("attention") if m.info.modality == "text"), None)
        return getattr(module.get("attention").params, "layout", "contiguous") if module else "contiguous"

    def vision_share_threshold(self) -> int | None:
        """Patches from which one image is shared by every SP rank (the vision attention's
        ``min_patches`` parameter, as ``vision_ulysses`` has); None: images are only spread."""
        module = next((m for m in self.modules_for("attention") if m.info.modality == "vision"), None)
        return getattr(module.get("attention").params, "min_patches", None) if module else None

    def frozen_units(self) -> list[str]:
        """Paths of the units whose shard rule says ``trainable = false``."""
        return [m.info.path for m in self.modules if m.info.kind == "unit" and m.get("shard") is not None
                and not getattr(m.get("shard").params, "trainable", True)]

    def quantized_units(self) -> dict[str, str]:
        """{unit path: method} for the units whose shard rule stores their linear weights quantised."""
        return {m.info.path: method for m in self.modules if m.info.kind == "unit" and m.get("shard") is not None
                and (method := getattr(m.get("shard").params, "quantize", "none")) != "none"}

    def modules_for(self, point: str, strategy: str | None = None) -> list[ModulePlan]:
        return [
            m
            for m in self.modules
            if (d := m.get(point)) is not None and (strategy is None or d.strategy == strategy)
        ]

    def to_json(self) -> dict:
        def module(m: ModulePlan) -> dict:
            shown = {key: getattr(m.info, field) for key, field in _INFO_KEYS}
            return shown | {"decisions": {d.point if d.point not in MULTI_POINTS else f"{d.point}.{d.strategy}":
                                          d.to_json() for d in m.decisions}}

        return {"world_size": self.world_size, "seq_len": self.seq_len, "mesh": attrs.asdict(self.mesh),
                "modules": [module(m) for m in self.modules]}


#: What `weft plan --json` shows of each module's info: (key, ModuleInfo field).
_INFO_KEYS = (("path", "path"), ("class", "class_name"), ("kind", "kind"), ("modality", "modality"),
              ("heads", "heads"), ("kv_heads", "kv_heads"), ("head_dim", "head_dim"))


class _RuleWhere:
    """Error locations inside a rule already parsed: 'file:line (point.key)'."""

    def __init__(self, source: str) -> None:
        self.path = source

    def at(self, dotted: str) -> str:
        return f"{self.path} ({dotted})"


def validate_rules(rules: Iterable[Rule], registry: StrategyRegistry) -> dict[tuple[int, str, int], Any]:
    """Check every rule's strategies and params; return built params by (rule, point, i)."""
    built: dict[tuple[int, str, int], Any] = {}
    for r, rule in enumerate(rules):
        for point, actions in rule.actions:
            for i, action in enumerate(actions):
                strategy = registry.get(point, action.strategy)
                if strategy is None:
                    names = registry.names(point)
                    raise RecipeError(
                        f"unknown {point} strategy {action.strategy!r}{did_you_mean(action.strategy, names)} "
                        f"Available: {', '.join(names) or '(none registered)'}",
                        where=f"{rule.source} ({point}.strategy)",
                    )
                built[(r, point, i)] = build(
                    strategy.params, dict(action.params), where=_RuleWhere(rule.source), prefix=point  # type: ignore[arg-type]
                )
    return built


def matches(selector: Selector, info: ModuleInfo, *, seq_len: int, world_size: int) -> bool:
    if selector.paths and not any(fnmatch.fnmatchcase(info.path, p) for p in selector.paths):
        return False
    if selector.classes and not any(fnmatch.fnmatchcase(info.class_name, c) for c in selector.classes):
        return False
    if selector.modalities and info.modality not in selector.modalities:
        return False
    values = {"heads": info.heads, "kv_heads": info.kv_heads, "head_dim": info.head_dim, "seq_len": seq_len,
              "world_size": world_size}
    for key, comparisons in selector.numbers:
        value = values[key]
        if value is None or not all(_OPS[c.op](value, c.value) for c in comparisons):
            return False
    return True


def _one_optimizer(plans: list[ModulePlan]) -> None:
    """One optimizer per run: rules may give modules other settings, not another strategy."""
    chosen = {}
    for m in plans:
        if (d := m.get("optimizer")) is not None:
            chosen.setdefault(d.strategy, d)
    if len(chosen) > 1:
        a, b = list(chosen.values())[:2]
        raise PlanError(f"optimizer rules choose two strategies, {a.strategy!r} ({a.source}) and {b.strategy!r} "
                        f"({b.source}); a run has one optimizer: give these modules settings (lr, lr_scale, "
                        "weight_decay) without a strategy, or the same strategy")


def _adapter_rules_decide(rules: list[Rule], plans: list[ModulePlan], registry: StrategyRegistry) -> None:
    """An adapter rule that decides no module would train nothing it promises: a plan error
    naming the rule (its ``when`` matches no module, or earlier rules decide them all)."""
    decided = {d.source for m in plans if (d := m.get("adapter")) is not None}
    for rule in rules:
        actions = rule.action("adapter")
        adds = actions and any(not registry.get("adapter", a.strategy).inert for a in actions)
        if adds and rule.source not in decided:
            raise PlanError(f"adapter rule {rule.name!r} decides no module: its when matches none of the model's "
                            "modules, or earlier rules decide them (`weft plan --explain` lists the modules)",
                            where=rule.source)


#: Accepted train.optimizer names that stand for another strategy (kept for older recipes).
OPTIMIZER_ALIASES = {"adamw_bf16_sr": "adamw_sr"}


def run_optimizer(recipe: Recipe) -> str:
    """The optimizer strategy ``train.optimizer`` names."""
    return OPTIMIZER_ALIASES.get(recipe.train.optimizer, recipe.train.optimizer)


def _run_optimizer(rule: Rule, recipe: Recipe) -> Rule:
    """An ``optimizer`` action without a strategy takes the run's (train.optimizer)."""
    actions = rule.action("optimizer")
    if not actions or all(a.strategy != RUN_STRATEGY for a in actions):
        return rule
    fixed = tuple(attrs.evolve(a, strategy=run_optimizer(recipe)) if a.strategy == RUN_STRATEGY else a
                  for a in actions)
    return attrs.evolve(rule, actions=tuple((p, fixed if p == "optimizer" else a) for p, a in rule.actions))


def build_plan(
    *,
    recipe: Recipe,
    modules: list[ModuleInfo],
    registry: StrategyRegistry,
    mesh: MeshSpec,
    world_size: int,
) -> Plan:
    """Decide every (module, hook point) pair. Raises RecipeError/PlanError for bad rules."""
    rules = [_run_optimizer(rule, recipe) for rule in (*recipe.rules, *default_rules())]
    try:
        params = validate_rules(rules, registry)
    except RecipeError as error:
        if recipe.source in str(error):
            raise
        # A rule of an included file or of the defaults: also name the recipe being planned.
        raise RecipeError(f"{error.message} (while planning {recipe.source})", where=error.where) from None
    seq_len = recipe.train.seq_len
    plans = []
    for info in modules:
        decisions: list[Decision] = []
        for point in HOOK_POINTS:
            if info.kind not in POINT_KINDS[point]:
                continue
            for r, rule in enumerate(rules):
                actions: tuple[Action, ...] | None = rule.action(point)
                if actions is None or not matches(rule.when, info, seq_len=seq_len, world_size=world_size):
                    continue
                for i, action in enumerate(actions):
                    decisions.append(
                        Decision(point=point, strategy=action.strategy, params=params[(r, point, i)],
                                 source=rule.source, rule=rule.name)
                    )
                break
            else:
                raise PlanError(f"no rule decides hook point {point!r} for module {info.path or '(root)'}; "
                                "the defaults should")
        plans.append(ModulePlan(info=info, decisions=tuple(decisions)))
    _one_optimizer(plans)
    _adapter_rules_decide(rules, plans, registry)
    plan = Plan(modules=tuple(plans), mesh=mesh, seq_len=seq_len, world_size=world_size, registry=registry)
    # Strategies that stand for others (attention 'auto') resolved once per module, here:
    # `weft plan`, the plan-time checks and the run all see the strategy that runs.
    return attrs.evolve(plan, modules=tuple(
        attrs.evolve(m, decisions=tuple(registry.resolved(d, info=m.info, plan=plan) for d in m.decisions))
        for m in plan.modules))
