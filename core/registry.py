"""Plain data the hooks exchange: strategy declarations, attention bindings, verdicts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs

from weft.core.hookspecs import HOOK_POINTS

if TYPE_CHECKING:
    from weft.core.recipe.rule_engine import Decision, ModuleInfo, Plan


@attrs.frozen(kw_only=True)
class NoParams:
    """Parameter class of a strategy that takes none."""


@attrs.frozen(kw_only=True)
class Strategy:
    """One named way of carrying out a hook point, declared by a plugin.

    ``params`` is an attrs class; a rule's table (less ``strategy``) is
    validated against its fields and becomes an instance of it in the Plan.
    """

    point: str = attrs.field(validator=attrs.validators.in_(HOOK_POINTS))
    name: str
    params: type = NoParams
    summary: str = ""
    plugin: str = ""  # filled in by the registry: which plugin declared it
    #: Attention strategies: the sequence-parallel mesh dims ("ulysses", "ring") the
    #: strategy spans. Text attention must span every SP dim of degree > 1, or each
    #: rank would attend only to its own part of the sequence.
    sp_dims: tuple[str, ...] = ()
    #: Attention strategies: mesh dims over which the strategy splits the heads; the
    #: product of their degrees must divide the module's query heads.
    head_split: tuple[str, ...] = ()
    #: Plan-time check of a rule's parameters against the recipe and the rest of the
    #: plan (device, precision, other points' choices):
    #: ``check(params, recipe=recipe, plan=plan) -> str | None``, a message saying why
    #: this choice cannot run, or None. Runs before any process starts.
    check: Callable[..., str | None] | None = None
    #: Plan-time resolution of a strategy that stands for others (attention ``auto``,
    #: ``local`` on a vision tower): ``resolve(params, *, info, plan) -> (name, params) | None``
    #: gives the strategy of the same point that this module runs (and an instance of its
    #: params class); None keeps this one. Called once per module when the Plan is built
    #: (``info``: the ModuleInfo; ``plan``: every decision as the rules made it), so `weft
    #: plan`, the plan-time checks and the run all see the one result; the result is not
    #: resolved again. May raise PlanError for a choice this module cannot run.
    resolve: Callable[..., tuple[str, Any] | None] | None = None
    #: Batching strategies: what `weft plan` shows of the data the strategy will feed,
    #: ``describe(params, *, recipe, plan, model, family, positions) -> dict`` with the
    #: optional keys ``vision_split`` (the first step's images per SP rank) and, when
    #: ``positions`` is true, ``positions`` (largest position ids; `weft plan --positions`).
    #: The root's shard strategy: ``lines``, what `weft plan` prints under the plan of what its
    #: rules do inside the units (e.g. which linear layers multiply in float8).
    describe: Callable[..., dict] | None = None
    #: What the strategy does: called by the hook implementation of the plugin that declares it,
    #: for each decision naming it, as ``impl(params, **arguments)``: the decision's params and the
    #: hook's other arguments by keyword (each plugin's module says which; attention:
    #: ``impl(params, module_path=, plan=, mesh=) -> AttentionBinding``). The hook implementation
    #: dispatches on the record (:class:`Declared`), never on the name. Shard strategies differ:
    #: the root's shapes the whole model, ``impl(model, units, *, plan, mesh, ctx) -> None``, with
    #: ``units`` every module of the Plan with a shard decision (root included, whatever strategy
    #: its rule names), on the model as built on the meta device; it may reuse the built-in levers
    #: (plugins/shard/levers.py), each of which acts on the units whose params carry its fields.
    impl: Callable[..., Any] | None = None
    #: The strategy leaves its modules as they are (adapter ``none``): the core counts a decision
    #: naming it as none (which modules are adapted, whether an adapter rule decides a module).
    inert: bool = False
    #: Shard strategies, for `weft plan --estimate`: the mesh dims ("dp_replicate", "dp_shard",
    #: "ring", "ulysses") whose ranks split a unit's weights, gradients and optimizer states (the
    #: product of their degrees divides them); () keeps them whole on every rank.
    shard_dims: tuple[str, ...] = ()
    #: Shard strategies: a unit's weights are gathered whole around its forward and backward and its
    #: gradients reduce-scattered in float32 (FSDP's way); the estimate counts the gathered copies,
    #: the float32 gradients of the reduce and the gathers' exposed time.
    gathers: bool = False
    #: Root-level strategies (grad_sync, optimizer, ...), for `weft plan --estimate`: what the root's
    #: decision adds to a rank's peak, ``estimate_memory(params, *, units, shape, setup) -> {part:
    #: bytes}`` (core/plan/estimate.py's Unit list, Shape and Setup); a part of its own is a row of
    #: the table, one of the core's names (``gradients``) adds to that row.
    estimate_memory: Callable[..., dict] | None = None
    #: The same for a step's seconds: ``estimate_time(params, *, units, shape, setup, gpu) ->
    #: {part: seconds}`` (``gpu``: core/plan/gpus.py's GpuKind).
    estimate_time: Callable[..., dict] | None = None
    #: Grad-sync strategies, for `weft check`: the gradients after this strategy, from the unsharded
    #: model's, ``reference(params, *, grads, norm) -> {name: tensor}`` (``grads``: float32 gradients
    #: by parameter name; ``norm``: their global L2 norm). The check then compares the ranks'
    #: gradients after grad sync with it too; None: only the gradients before it and the norm.
    reference: Callable[..., dict] | None = None
    #: kv_cache strategies: the cache holds several prompts of different lengths at once, each row
    #: at its own position; `weft generate` decodes several prompts together in one.
    batched_prompts: bool = False


class Declared:
    """A plugin's own strategies, by (point, name): what its ``weft_strategies`` returns and what
    its hook implementations dispatch on. ``of(decision)`` is None for a strategy another plugin
    declared (a firstresult hook then answers None)."""

    def __init__(self, *strategies: Strategy) -> None:
        self._by_key = {(s.point, s.name): s for s in strategies}

    def list(self) -> list[Strategy]:
        return list(self._by_key.values())

    def of(self, decision: Any) -> Strategy | None:
        return self._by_key.get((decision.point, decision.strategy))

    def get(self, point: str, name: str) -> Strategy | None:
        return self._by_key.get((point, name))

    def answer(self, decision: Any, **arguments: Any) -> Any:
        """A firstresult hook's answer: ``impl(decision.params, **arguments)`` of the decision's
        strategy where it is one of these, else None (another plugin's strategy)."""
        strategy = self.of(decision)
        return None if strategy is None else strategy.impl(decision.params, **arguments)


@attrs.frozen(kw_only=True)
class AttentionBinding:
    """What ``weft_attention`` returns: a name for transformers' AttentionInterface
    and the function registered under it (signature of transformers' attention
    functions: ``fn(module, query, key, value, attention_mask, **kwargs) -> (out, weights)``)."""

    name: str
    fn: Callable[..., Any] | None = None  # None: a name transformers already knows ("sdpa")


@attrs.frozen(kw_only=True, eq=False)
class OptimizerGroup:
    """What ``weft_optimizer`` receives per parameter group: the trainable parameters whose
    module one ``optimizer`` decision covers, and that group's resolved peak settings."""

    decision: Any  # weft.core.recipe.rule_engine.Decision of the ``optimizer`` point
    params: tuple[Any, ...]  # the torch parameters (DTensors under FSDP2)
    lr: float  # the rule's lr, else train.lr; times the rule's lr_scale
    weight_decay: float  # the rule's weight_decay, else train.weight_decay
    modules: tuple[str, ...] = ()  # the module paths whose parameters it holds ("" = the root's own)


@attrs.frozen(kw_only=True, eq=False)
class Adapters:
    """What ``weft_adapter`` returns: the parameters it added (their names in the model as it
    was given, before any wrapping) and ``init(model, seed=...)``, which fills them once the
    base's weights are in place (after sharding, on their devices): the core calls it after
    the weights are loaded or drawn, and the `weft check` reference likewise."""

    names: tuple[str, ...]
    init: Callable[..., None]
    summary: dict = attrs.field(factory=dict)  # what `weft plan` and the run's log show
    #: ``merge(model)``: fold the trained adapters into the base's weights and remove their
    #: layers, in place, on a whole (unsharded) model: what `weft export` writes. None: cannot.
    merge: Callable[..., None] | None = None
    #: ``save(model, tensors, out_dir, *, base)``: write the trained adapters (``tensors``: their
    #: values by name in the model, read from a checkpoint) as the library that loads them expects
    #: (PEFT's adapter directory), ``model`` built on the meta device with the adapters added,
    #: ``base`` the model they adapt (a path or a preset's name). None: only a merged export.
    save: Callable[..., None] | None = None


class Objective:
    """What ``weft_objective`` returns: how a micro-batch's forward becomes its loss.

    The core calls, per micro-batch, ``units(batch, target)`` (this rank's share of the step's
    divisor, a tensor: label tokens for the next-token loss, pairs for a preference loss; the
    core sums it over every rank once a step) and ``loss_sum(model=, batch=, target=, fused=,
    extra=)``: the loss summed over those units, whose ``* world_size / total`` the core
    backpropagates. ``batch`` is the model's inputs (labels and the objective's own keys
    removed); ``target`` (B, S_local) the token each position predicts (-100: none), on this
    rank's part of the sequence; ``fused`` the ``train.loss = "fused"`` head or None;
    ``extra`` the keys named below: ``token_keys`` (B, S) aligned with the labels the
    micro-batch carries (shifted like ``labels``; as given beside a packed row's
    ``shift_labels``) and cut like them, ``batch_keys`` as batching gave them (a key the
    micro-batch lacks is left out). A loss counted on every rank of a sequence-parallel
    group (a sum over whole sequences) counts its units on every rank too: the group's
    repeats cancel in the mean, and the all-reduce's backward adds each rank's gradient.
    """

    token_keys: tuple[str, ...] = ()
    batch_keys: tuple[str, ...] = ()
    #: What the units are, for the run's log and `weft report` ("tokens", "pairs").
    unit: str = "tokens"

    def units(self, batch: dict, target: Any) -> Any:
        raise NotImplementedError

    def loss_sum(self, *, model: Any, batch: dict, target: Any, fused: Any, extra: dict) -> Any:
        raise NotImplementedError

    def begin_step(self) -> None:
        """A step's (or a held-out pass's) micro-batches begin: forget the sums of the last."""

    def step_stats(self) -> dict[str, Any]:
        """What to log beside the loss, each a sum over this rank's units since ``begin_step``
        (0-dim tensors); the core all-reduces them with the loss and logs each over the units."""
        return {}


VERDICTS: tuple[str, ...] = ("continue", "checkpoint", "skip", "abort")  # weakest first


@attrs.frozen(kw_only=True)
class Verdict:
    """A guard's answer for one step."""

    action: str = attrs.field(validator=attrs.validators.in_(VERDICTS))
    reason: str = ""
    guard: str = ""

    @staticmethod
    def strongest(verdicts: list["Verdict"]) -> "Verdict":
        if not verdicts:
            return Verdict(action="continue")
        return max(verdicts, key=lambda v: VERDICTS.index(v.action))


class StrategyRegistry:
    """Every strategy the loaded plugins declared, by (point, name). Read-only after build."""

    def __init__(self, strategies: list[Strategy]) -> None:
        self._by_key: dict[tuple[str, str], Strategy] = {}
        for strategy in strategies:
            key = (strategy.point, strategy.name)
            if key in self._by_key:
                other = self._by_key[key]
                from weft.core.errors import PlanError

                raise PlanError(
                    f"strategy {strategy.name!r} for hook point {strategy.point!r} is declared twice: "
                    f"by plugin {other.plugin!r} and by plugin {strategy.plugin!r}; "
                    "disable one with WEFT_DISABLE_PLUGINS"
                )
            self._by_key[key] = strategy

    def get(self, point: str, name: str) -> Strategy | None:
        return self._by_key.get((point, name))

    def resolved(self, decision: Decision, *, info: ModuleInfo, plan: Plan) -> Decision:
        """``decision`` (a Plan's Decision) as its strategy's ``resolve`` names it for the module
        ``info``: the strategy that runs, ``resolved_from`` the one its rule named. Unchanged
        when the strategy declares no ``resolve`` or keeps itself."""
        strategy = self.get(decision.point, decision.strategy)
        chosen = strategy.resolve(decision.params, info=info, plan=plan) if strategy and strategy.resolve else None
        if chosen is None or chosen[0] == decision.strategy:
            return decision
        name, params = chosen
        target = self.get(decision.point, name)
        if target is None or not isinstance(params, target.params):
            from weft.core.errors import PlanError

            raise PlanError(f"{info.path or '(root)'}: {decision.point} strategy {decision.strategy!r} (plugin "
                            f"{strategy.plugin!r}) resolved to {name!r} with {type(params).__name__}, which is "
                            "not a registered strategy with its params")
        return attrs.evolve(decision, strategy=name, params=params, resolved_from=decision.strategy)

    def names(self, point: str) -> list[str]:
        return sorted(name for (p, name) in self._by_key if p == point)

    def all(self) -> list[Strategy]:
        return sorted(self._by_key.values(), key=lambda s: (HOOK_POINTS.index(s.point), s.name))
