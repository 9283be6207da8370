"""The contract between weft's core loop and its plugins: every hook point, in one place.

The core calls these hooks in this order, once per run unless said otherwise:

1. ``weft_strategies``   when the plugin manager is built: collect named strategies;
   ``weft_models``       likewise: collect model families.
2. ``weft_rope``         once, after the Plan: the text decoder's rotary keys (the model rebuilt from them);
   ``weft_adapter``      once, on the model as built (meta device), before sharding: adapters (LoRA);
   ``weft_shard``        once, after the model is built and the mesh exists.
3. ``weft_attention``    once per (strategy, module) pair the Plan names.
4. ``weft_optimizer``    once per run (training only): the optimizer over the Plan's parameter groups;
   ``weft_batching``     once: returns this rank's iterator of optimizer steps;
   ``weft_objective``    once: what each micro-batch's forward turns into its loss.
5. per optimizer step:   ``weft_guard(event="step_start")`` -> forward/backward for each
   micro-batch -> ``weft_grad_sync`` -> ``weft_guard(event="step_end")`` -> optimizer ->
   ``weft_metrics(event="step")`` (rank 0), and ``weft_metrics(event="end")`` once at the end.
6. ``weft_guard(event="error")`` when a step raises; ``weft_kv_cache`` once per `weft generate`.

Arguments are frozen objects (Plan, Decision, Recipe, the RunContext) or the live model/mesh; a plugin
returns what it makes instead of mutating shared arguments. Firstresult hooks are
dispatched on the decision's strategy: an implementation answers through the record it
declared (``Declared.of(decision)``, core/registry.py) and returns ``None`` for strategies
it does not own. The core calls each hook (but the two collected while the manager is built)
through its typed call, ``pm.<point>(...)`` (core/hook_calls.py, held to these specs by
tests/test_hook_calls.py); a firstresult one raises ``HookError`` naming the hook and the
registered plugins when nobody answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import pluggy

if TYPE_CHECKING:  # the contract's types, as pytest's hookspec.py does: no import cost at run time
    import torch
    from transformers import Cache

    from weft.core.context import RunContext, StepState
    from weft.core.mesh import WeftMesh
    from weft.core.models import ModelFamily
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import Decision, Plan
    from weft.core.registry import Adapters, AttentionBinding, Objective, OptimizerGroup, Strategy, Verdict

PROJECT = "weft"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The hook points a rule can steer, in the order a run meets them.
HOOK_POINTS: tuple[str, ...] = ("rope", "adapter", "shard", "attention", "kv_cache", "batching", "objective",
                                "grad_sync", "guard", "optimizer", "metrics")
#: The collect-all points: a rule may give them a list of strategies, all of which apply.
MULTI_POINTS: tuple[str, ...] = ("grad_sync", "guard", "metrics")


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------


@hookspec
def weft_strategies() -> list[Strategy]:
    """Declare the named strategies this plugin provides.

    When: once, while the plugin manager is built (before any recipe is read).
    Kind: collect-all; every plugin returns a list of
    :class:`weft.core.registry.Strategy` (point, name, params class, summary).
    May change: nothing; it only describes. The params class is an attrs class
    whose fields are the strategy's rule parameters; the rule engine validates
    a rule's table against it, so third-party strategies get the same checks.
    Collectives: none.
    """


@hookspec
def weft_models() -> list[ModelFamily]:
    """Declare the model families this plugin adapts.

    When: once, while the plugin manager is built.
    Kind: collect-all; every plugin returns a list of model families, objects that meet
    :class:`weft.core.models.ModelFamily` (most subclass
    ``weft.plugins.models.base.TransformersFamily``). Each names the
    ``config.model_type`` values it handles; two plugins claiming one type is an error.
    The core picks the family from the recipe's model and asks it to build the
    model, describe its modules for the rules, and cut its inputs for sequence
    parallelism; an unknown ``model_type`` is an exit-2 message listing the families.
    Collectives: none.
    """


# ---------------------------------------------------------------------------
# model preparation
# ---------------------------------------------------------------------------


@hookspec
def weft_adapter(model: torch.nn.Module, plan: Plan, ctx: RunContext) -> Adapters | None:
    """Add trainable adapters (LoRA) to the modules the Plan's ``adapter`` decisions name; freeze the base.

    When: once per run (and per `weft check` reference), after the model is built (on the meta
    device, with the rotary keys of ``weft_rope``) and before ``weft_shard``, compile and the
    optimizer, so the adapters are sharded, checkpointed and optimised like the base's modules;
    also on the planner's own meta model (`weft plan`, the checks before a run) with ``ctx=None``.
    Kind: collect-all; each implementation acts on the modules whose ``adapter`` decision names
    one of its strategies and returns an :class:`weft.core.registry.Adapters` (the names of the
    parameters it added and how to fill them once the weights are in place) or ``None``.
    May change: the model's modules, in place (children replaced by wrapping layers, base
    parameters' ``requires_grad``); never the root object.
    Collectives: none.
    """


@hookspec
def weft_shard(model: torch.nn.Module, plan: Plan, mesh: WeftMesh, ctx: RunContext) -> None:
    """Wrap or shard the model's modules: FSDP2 groups, HSDP, activation checkpointing.

    When: once per run, after the model is built and before the optimizer exists.
    Kind: collect-all; each implementation handles only the modules whose
    ``plan.decisions("shard")`` name one of its strategies, deepest modules first,
    and returns ``None``. It may wrap modules in place (``fully_shard``,
    checkpoint wrappers); it must not replace the root module object. The model
    arrives on the meta device; an implementation whose sharding needs the real
    weights may materialise it first (``ctx.family.materialize``: 4-bit units under
    FSDP2 are quantised before ``fully_shard``); the core materialises whatever is
    still on the meta device after this hook.
    Collectives: FSDP2 broadcasts nothing at wrap time; sharding is local.
    """


@hookspec(firstresult=True)
def weft_rope(decision: Decision, recipe: Recipe, plan: Plan) -> dict | None:
    """Choose the text decoder's rotary scaling.

    When: once per run (and per `weft plan`, `check`, `eval`, `generate`), after the
    Plan and before the model is materialised; ``decision`` is the text attention
    modules' ``rope`` decision.
    Kind: firstresult on ``decision.strategy``; return the recipe's ``[model]``
    rotary keys to build the text decoder with (any of ``rope_scaling``: none,
    yarn, linear or dynamic; ``rope_factor``; ``rope_original_max``), ``{}`` to
    keep the recipe's own, or ``None`` when the strategy is not yours. The model
    is then built from those keys, so a rule and the keys give the same tables;
    transformers computes them from its ``rope_parameters``. A rule that changes
    keys the recipe set otherwise is a plan error naming both.
    May change: nothing; it only answers.
    Collectives: none.
    """


@hookspec(firstresult=True)
def weft_attention(decision: Decision, module_path: str, plan: Plan, mesh: WeftMesh,
                   ctx: RunContext) -> AttentionBinding | None:
    """Give one attention module its attention function.

    When: once per attention module the Plan lists, after ``weft_shard``.
    Kind: firstresult on ``decision.strategy``; return an
    :class:`weft.core.registry.AttentionBinding` (a name registered with
    transformers' ``AttentionInterface`` and the callable) or ``None`` when the
    strategy is not yours. ``decision.strategy`` is the one that runs: a
    strategy with ``resolve`` (attention ``auto``) was resolved per module
    when the Plan was built. The core sets ``attn_implementation`` per module
    from the binding; no transformers internals are patched.
    Collectives: none at install time; the returned function may issue
    sequence-parallel collectives (all-to-all, send/recv) on every call.
    """


@hookspec(firstresult=True)
def weft_kv_cache(decision: Decision, model: torch.nn.Module, plan: Plan, mesh: WeftMesh,
                  ctx: RunContext) -> Cache | None:
    """Build the key/value cache `weft generate` prefills and decodes from.

    When: once per generation, after the model is ready, before the prefill; never
    during training steps.
    Kind: firstresult on ``decision.strategy`` (the text decoder's); return a
    transformers ``Cache`` object or ``None`` when the strategy is not yours. The
    prefill runs the plan's attention (under sequence parallelism each rank's
    layers see their part of the prompt); the core then calls the cache's
    ``begin_decode()`` if it has one and, if the cache names a
    ``decode_attention`` (an AttentionInterface name), decodes the text model
    with it. A cache with ``begin_prefill(keep=, prompt=)`` is told which of this
    rank's prompt rows are real tokens (the core pads to the split's multiple)
    and the prompt's length.
    May change: nothing on the model.
    Collectives: none at build time; a sequence-sharded cache gathers on use.
    """


@hookspec(firstresult=True)
def weft_batching(
    decision: Decision, recipe: Recipe, plan: Plan, mesh: WeftMesh, model: torch.nn.Module, ctx: RunContext
) -> Iterable[list[dict[str, torch.Tensor]]] | None:
    """Turn the recipe's data into this rank's optimizer steps.

    When: once per run, after the model is ready (and again on resume, from
    ``ctx.start_step``; once more before the first step with ``[eval]``, the recipe's
    data replaced by ``[eval.data]``); `weft check` takes the first step. With
    ``ctx.one_pass`` (`weft eval`, ``[eval]``) yield every sample exactly once, then end the iterator; pad a
    last round that leaves some data-parallel ranks without a micro-batch with
    copies whose labels are all -100 (they must still run the forward).
    Kind: firstresult on ``decision.strategy``; return an iterable of steps,
    each a list of micro-batches, or ``None`` when the strategy is not yours. A
    micro-batch is a dict of whole-sequence tensors: ``input_ids``,
    ``attention_mask`` and ``labels`` (B, S), plus the model's image inputs
    (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) when it has
    images. Batching never sees sequence parallelism: the core pads each
    micro-batch to the split's multiple, shifts the labels on the whole
    sequence and cuts them like the model's inputs; the model family's hooks
    cut the rest after the vision merge. Data-parallel ranks (``mesh.dp_rank()``
    of ``plan.mesh.dp``) take disjoint data; the ranks of one sequence-parallel
    group must yield the same micro-batches. Every rank must yield the same
    number of steps and of micro-batches per step, since each micro-batch
    issues collectives. Bad samples are skipped and counted in
    ``ctx.counters["skipped_samples"]``.
    Collectives: none required; a strategy may all-gather lengths.
    """


@hookspec(firstresult=True)
def weft_objective(decision: Decision, plan: Plan, mesh: WeftMesh, ctx: RunContext) -> Objective | None:
    """Choose what a step minimises: the next-token loss (``sft``), a preference loss (``dpo``), a plugin's own.

    When: once per run, after ``weft_shard`` and the attention. Kind: firstresult on ``decision.strategy``;
    return an :class:`weft.core.registry.Objective` (``units`` per micro-batch, ``loss_sum`` over them) or
    ``None``. May change: nothing on the model. Collectives: a whole-sequence loss sums over ``mesh.sp``.
    """


@hookspec
def weft_grad_sync(model: torch.nn.Module, plan: Plan, mesh: WeftMesh,
                   ctx: RunContext) -> list[tuple[str, torch.Tensor]] | None:
    """Finish gradients after backward and before the optimizer step.

    When: once per optimizer step, after the last micro-batch's backward.
    Kind: collect-all; each implementation whose strategy the Plan's
    ``grad_sync`` decision names acts, the rest return ``None``. May reduce
    gradients replicated across sequence-parallel ranks, cast reduce dtypes
    and clip. An implementation that measures the gradient norm returns
    ``[("grad_norm", tensor)]``; the core logs it without a host sync until
    the metrics line.
    Collectives: all-reduce over the mesh dimensions it syncs.
    """


@hookspec
def weft_guard(event: str, state: StepState, plan: Plan, ctx: RunContext) -> Verdict | None:
    """Watch each step and each error; answer with verdicts.

    When: ``event="step_start"`` before a step's first micro-batch,
    ``event="step_end"`` after grad sync and before the optimizer step,
    ``event="error"`` when a step raises.
    Kind: collect-all; each returns a :class:`weft.core.registry.Verdict`
    (``continue``, ``skip``, ``checkpoint`` or ``abort`` with a reason) or ``None``.
    The strongest verdict wins: abort > skip > checkpoint > continue.
    Collectives: a guard that decides from local values must all-reduce them,
    so every rank reaches the same verdict.
    """


@hookspec(firstresult=True)
def weft_optimizer(decision: Decision, groups: list[OptimizerGroup], recipe: Recipe,
                   ctx: RunContext) -> torch.optim.Optimizer | None:
    """Make the run's optimizer.

    When: once per training run, after ``weft_shard`` and the weights are in place,
    before the first step (and before a resumed run loads its checkpoint).
    Kind: firstresult on ``decision.strategy``; return a ``torch.optim.Optimizer`` or
    ``None`` when the strategy is not yours. ``groups`` are the trainable parameters
    split by the ``optimizer`` rule that decides their module (the innermost shard unit
    holding them, else the root), each an :class:`weft.core.registry.OptimizerGroup`
    with its decision, its peak ``lr`` and ``weight_decay`` already resolved from the
    rule's ``lr`` / ``lr_scale`` / ``weight_decay`` and ``[train]``; make one torch
    param group per group, in this order, with those values (the core's warmup + cosine
    schedule scales each group's ``lr``). One optimizer strategy per run: rules may give
    modules different settings, not different strategies. An optimizer whose bf16
    updates are not lost to round-to-nearest says so with ``bf16_rounding =
    "stochastic"`` (the ``update`` guard reads it).
    May change: nothing but the optimizer it makes (no parameter is replaced).
    Collectives: none at build time; a step may issue its own (sharded states).
    """


@hookspec
def weft_metrics(event: str, row: dict, plan: Plan, ctx: RunContext) -> None:
    """Write the run's metrics somewhere: a file, TensorBoard, an experiment tracker.

    When: on rank 0 only; ``event="step"`` with each step's metrics row (``step``,
    ``loss``, ``tokens``, ``tokens_per_s``, ``lr``, ``grad_norm``, ``step_s``,
    ``skipped``, phase times, ``max_memory_gib`` on a GPU; a guard's abort adds
    ``aborted``), then ``event="end"`` once with the run's summary (as
    summary.json) when it completes or is interrupted.
    Kind: collect-all; each implementation acts for its strategies among
    ``plan.decisions_of("metrics")`` and returns nothing. Several sinks may run
    together (``metrics = [{ strategy = "jsonl" }, { strategy = "tensorboard" }]``).
    A sink keeps what it opens in ``ctx.plugin_state`` (per run) and flushes on
    every row, so a killed run keeps what it logged.
    May change: nothing but its own outputs.
    Collectives: none (rank 0 alone calls it).
    """
