"""The core's calls of its hooks, typed: one method per hook of core/hookspecs.py.

``pm.shard(model=, plan=, mesh=, ctx=)`` in place of ``pm.call_all("weft_shard", ...)``: the
hook's name and its arguments are then names the core's code spells once, here, and a test
(tests/test_hook_calls.py) holds each method to its spec (same parameters, same types), so a
hook added without its call, or a call that drifts from its spec, fails. Every argument is
keyword-only, as pluggy passes them. Firstresult hooks go through ``call_first`` (an answer, or
``HookError`` naming the hook and the registered plugins), collect-all hooks through
``call_all`` (a plugin that raises is named in a ``PluginError``); both are
:class:`weft.core.plugin_manager.WeftPluginManager`'s, which this class is mixed into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # annotations only: building a plugin manager imports no torch
    import torch
    from transformers import Cache

    from weft.core.context import RunContext, StepState
    from weft.core.mesh import WeftMesh
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import Decision, Plan
    from weft.core.registry import Adapters, AttentionBinding, Objective, OptimizerGroup, Verdict

#: Hooks the plugin manager collects itself while it is built (``pm.registry``, ``pm.models``),
#: reading each implementation's answer apart so that one broken plugin is named and left out;
#: the core never calls them during a run, so they have no typed call.
COLLECTED: tuple[str, ...] = ("weft_strategies", "weft_models")


class HookCalls:
    """One method per hook the core calls, named after the hook without its ``weft_`` prefix."""

    if TYPE_CHECKING:  # WeftPluginManager's
        def call_all(self, hook_name: str, **kwargs: Any) -> list: ...

        def call_first(self, hook_name: str, **kwargs: Any) -> Any: ...

    # model preparation -------------------------------------------------------------------

    def adapter(self, *, model: torch.nn.Module, plan: Plan, ctx: RunContext) -> list[Adapters]:
        """``weft_adapter`` (collect-all): the adapters each plugin added. ``ctx`` is None on the
        planner's own meta model."""
        return self.call_all("weft_adapter", model=model, plan=plan, ctx=ctx)

    def shard(self, *, model: torch.nn.Module, plan: Plan, mesh: WeftMesh, ctx: RunContext) -> None:
        """``weft_shard`` (collect-all): the model's modules wrapped or sharded in place."""
        self.call_all("weft_shard", model=model, plan=plan, mesh=mesh, ctx=ctx)

    def rope(self, *, decision: Decision, recipe: Recipe, plan: Plan) -> dict:
        """``weft_rope`` (firstresult): the text decoder's rotary keys, ``{}`` for the recipe's own."""
        return self.call_first("weft_rope", decision=decision, recipe=recipe, plan=plan)

    def attention(self, *, decision: Decision, module_path: str, plan: Plan, mesh: WeftMesh,
                  ctx: RunContext) -> AttentionBinding:
        """``weft_attention`` (firstresult): one attention module's function."""
        return self.call_first("weft_attention", decision=decision, module_path=module_path, plan=plan, mesh=mesh,
                               ctx=ctx)

    def kv_cache(self, *, decision: Decision, model: torch.nn.Module, plan: Plan, mesh: WeftMesh,
                 ctx: RunContext) -> Cache:
        """``weft_kv_cache`` (firstresult): the cache `weft generate` prefills and decodes from."""
        return self.call_first("weft_kv_cache", decision=decision, model=model, plan=plan, mesh=mesh, ctx=ctx)

    # the run -------------------------------------------------------------------------------

    def batching(self, *, decision: Decision, recipe: Recipe, plan: Plan, mesh: WeftMesh, model: torch.nn.Module,
                 ctx: RunContext) -> Iterable[list[dict[str, torch.Tensor]]]:
        """``weft_batching`` (firstresult): this rank's optimizer steps, each a list of micro-batches."""
        return self.call_first("weft_batching", decision=decision, recipe=recipe, plan=plan, mesh=mesh, model=model,
                               ctx=ctx)

    def objective(self, *, decision: Decision, plan: Plan, mesh: WeftMesh, ctx: RunContext) -> Objective:
        """``weft_objective`` (firstresult): what each micro-batch's forward turns into its loss."""
        return self.call_first("weft_objective", decision=decision, plan=plan, mesh=mesh, ctx=ctx)

    def optimizer(self, *, decision: Decision, groups: list[OptimizerGroup], recipe: Recipe,
                  ctx: RunContext) -> torch.optim.Optimizer:
        """``weft_optimizer`` (firstresult): the run's optimizer over ``groups``."""
        return self.call_first("weft_optimizer", decision=decision, groups=groups, recipe=recipe, ctx=ctx)

    def grad_sync(self, *, model: torch.nn.Module, plan: Plan, mesh: WeftMesh,
                  ctx: RunContext) -> list[list[tuple[str, torch.Tensor]]]:
        """``weft_grad_sync`` (collect-all): each answering plugin's measured values."""
        return self.call_all("weft_grad_sync", model=model, plan=plan, mesh=mesh, ctx=ctx)

    def guard(self, *, event: str, state: StepState, plan: Plan, ctx: RunContext) -> list[Verdict]:
        """``weft_guard`` (collect-all): each guard's verdict on the step or the error."""
        return self.call_all("weft_guard", event=event, state=state, plan=plan, ctx=ctx)

    def metrics(self, *, event: str, row: dict, plan: Plan, ctx: RunContext) -> None:
        """``weft_metrics`` (collect-all): the row (``event="step"``) or the summary (``"end"``) written."""
        self.call_all("weft_metrics", event=event, row=row, plan=plan, ctx=ctx)
