"""Test-only plugins, loaded into `weft run` subprocesses through a real entry point.

- batching ``fixed_global``: step s is the same global batch whatever the world size:
  samples [s*k, (s+1)*k) cut into ``parts`` micro-batches; data-parallel rank d takes
  parts d, d+dp, ... So dp=2 and dp=1 (accumulating two micro-batches) see the same data.
- guard ``kill``: SIGKILLs one rank at the start of one step (only in a fresh run), to
  test that a crash costs only the steps since the last checkpoint.
- guard ``freeze``: SIGSTOPs one rank at the start of one step: a peer that stops
  responding (a frozen host, a wedged driver) without dying.
- guard ``nan_from``: from step ``step`` on, the step's gradient norm reads NaN to the
  guards after it (entry-point plugins are called before the built-in ones): the fault
  "NaN at step k" as the built-in ``finite`` guard sees it.
- guard ``raise_at``: raises at the start of step ``step``: a plugin that breaks.
- guard ``oom_at``: raises torch's OutOfMemoryError at the start of step ``step``, as a
  step that runs out of GPU memory would.
"""

import os
import signal

import attrs

from weft.core.hookspecs import hookimpl
from weft.core.registry import Strategy


@attrs.frozen(kw_only=True)
class FixedGlobalParams:
    samples_per_step: int = 4
    parts: int = 2


@attrs.frozen(kw_only=True)
class KillParams:
    step: int = 1
    rank: int = 1


@attrs.frozen(kw_only=True)
class StepParams:
    step: int = 1


@hookimpl
def weft_strategies():
    return [
        Strategy(point="batching", name="fixed_global", params=FixedGlobalParams,
                 summary="test: the same global batch at any world size"),
        Strategy(point="guard", name="kill", params=KillParams, summary="test: SIGKILL one rank at one step"),
        Strategy(point="guard", name="freeze", params=KillParams, summary="test: SIGSTOP one rank at one step"),
        Strategy(point="guard", name="nan_from", params=StepParams, summary="test: NaN gradient norm from a step"),
        Strategy(point="guard", name="raise_at", params=StepParams, summary="test: raise at one step"),
        Strategy(point="guard", name="oom_at", params=StepParams, summary="test: out of memory at one step"),
    ]


@hookimpl
def weft_batching(decision, recipe, plan, mesh, model, ctx):
    if decision.strategy != "fixed_global":
        return None
    from weft.strategies.data.conversation import collate, encode_conversation, load_processor
    from weft.strategies.data.synthetic_vl import synthetic_conversations

    # Whole sequences only: under sequence parallelism the core pads and cuts them.
    tokenizer, image_processor = load_processor(ctx.family.config(recipe)[1])
    # At least one part per data-parallel rank: the same samples, grouped differently.
    k, dp, me = decision.params.samples_per_step, plan.mesh.dp, mesh.dp_rank()
    parts = max(decision.params.parts, dp)
    conversations = synthetic_conversations(seed=recipe.train.seed, num_samples=k * recipe.train.max_steps,
                                            min_side=28, max_side=84)
    samples = [encode_conversation(c.messages, tokenizer=tokenizer, image_processor=image_processor)
               for c in conversations]

    def steps():
        for step in range(ctx.start_step, recipe.train.max_steps):
            chunk = samples[step * k : (step + 1) * k]
            micro = []
            for part in range(me, parts, dp):
                micro.append(collate(chunk[part::parts], pad_id=tokenizer.pad_token_id))
            yield micro

    return steps()


@hookimpl
def weft_guard(event, state, plan, ctx):
    for decision in plan.decisions_of("guard"):
        if decision.strategy == "kill" and event == "step_start" and ctx.start_step == 0:
            if state.step == decision.params.step and ctx.rank == decision.params.rank:
                os.kill(os.getpid(), signal.SIGKILL)
        if decision.strategy == "freeze" and event == "step_start" and state.step == decision.params.step:
            if ctx.rank == decision.params.rank:
                os.kill(os.getpid(), signal.SIGSTOP)
        if decision.strategy == "nan_from" and event == "step_end" and state.step >= decision.params.step:
            state.grad_norm = float("nan")
        if decision.strategy == "raise_at" and event == "step_start" and state.step == decision.params.step:
            raise RuntimeError(f"injected failure at step {state.step}")
        if decision.strategy == "oom_at" and event == "step_start" and state.step == decision.params.step:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.12 GiB (a page of statistics)")
    return None
