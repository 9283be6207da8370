"""The objective hook point (plugins/objective.py): ``sft`` by default, ``dpo`` by rule, a third
party's own objective through the same core step; the DPO loss that the core's step computes
and backpropagates equals the formula over a transformers model's summed response
log-probabilities (float64: loss and every gradient), is ln 2 with the policy as its own
reference, and is the one-rank loss and gradient under ring 2 and Ulysses 2."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_ranks
from weft.core.context import RunContext
from weft.core.errors import HookError, WeftError
from weft.core.hookspecs import hookimpl
from weft.core.mesh_spec import MeshSpec
from weft.core.plugin_manager import build_plugin_manager
from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import Decision, ModuleInfo, build_plan
from weft.core.registry import NoParams, Objective, Strategy
from weft.core.train.loss import IGNORE, label_count, token_loss_sum
from weft.core.train.step import NextToken, run_micro_batches

BETA = 0.1
ROOT = ModuleInfo(path="", kind="root", modality=None, class_name="Model")
TINY = {"model": {"preset": "qwen2_text_tiny"}}


class PerRow(Objective):
    """A third party's objective: each row's mean token loss, the mean over rows."""

    unit = "rows"

    def units(self, batch, target):
        return torch.tensor(float(target.shape[0]))

    def loss_sum(self, *, model, batch, target, fused, extra):
        logits = model(**batch, use_cache=False).logits
        rows = [token_loss_sum(logits[i:i + 1], target[i:i + 1]) / label_count(target[i]) for i in range(len(target))]
        return torch.stack(rows).sum()


class PerRowPlugin:
    @hookimpl
    def weft_strategies(self):
        return [Strategy(point="objective", name="per_row", summary="each row's mean token loss")]

    @hookimpl
    def weft_objective(self, decision):
        return PerRow() if decision.strategy == "per_row" else None


def _plan(pm, rules):
    recipe = Recipe.from_dict({**TINY, "rules": rules})
    return build_plan(recipe=recipe, modules=[ROOT], registry=pm.registry, mesh=MeshSpec(), world_size=1)


def _ctx(world: int = 1, rank: int = 0) -> RunContext:
    return RunContext(recipe=Recipe.from_dict(TINY), device=torch.device("cpu"), rank=rank, world_size=world,
                      log=structlog.get_logger())


@contextlib.contextmanager
def _one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(seed: int = 0):
    from model_helpers import build_model

    return build_model(Recipe.from_dict(TINY), seed=seed).double()


def _pairs(length: int = 24):
    """Two pairs, rows chosen 0, rejected 0, chosen 1, rejected 1: a prompt, then a response,
    right-padded to ``length``; labels on the responses. Each response's tokens carry its
    sequence id (2p chosen, 2p + 1 rejected). (ids, labels, sequence), each (4, length)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(4, length, dtype=torch.long)
    labels = torch.full((4, length), IGNORE)
    sequence = torch.full((4, length), -1)
    for row, (prompt, response) in enumerate([(5, 4), (5, 7), (9, 6), (9, 3)]):
        ids[row, :prompt + response] = torch.randint(1, 300, (prompt + response,), generator=g)
        if row % 2:  # the same prompt as the chosen row's
            ids[row, :prompt] = ids[row - 1, :prompt]
        labels[row, prompt:prompt + response] = ids[row, prompt:prompt + response]
        sequence[row, prompt:prompt + response] = row
    return ids, labels, sequence


def _by_hand(model, ids, labels) -> torch.Tensor:
    """Each row's summed log-probability of its labels, the textbook way. (4,)"""
    logp = model(input_ids=ids).logits[:, :-1].log_softmax(-1)
    picked = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1)
    return (picked * (labels[:, 1:] != IGNORE)).sum(-1)


def _micro_batch(ids, labels, sequence, reference):
    """A preference micro-batch; ``reference`` None: without the reference key."""
    batch = {"input_ids": ids, "labels": labels, "weft_sequence": sequence, "weft_pairs": torch.tensor(2),
             "weft_reference": reference}
    return {k: v for k, v in batch.items() if v is not None}


def _dpo(**params):
    from weft.plugins.objective import Preference, PreferenceParams

    return Preference(PreferenceParams(**params), group=None)


@pytest.mark.quick
def test_hook_weft_objective():
    pm = build_plugin_manager(extra=[("per-row", PerRowPlugin())], entry_points=False)
    # The default rule: the next-token loss.
    default = _plan(pm, []).decision("objective")
    assert default.strategy == "sft"
    assert isinstance(pm.objective(decision=default, plan=_plan(pm, []), mesh=None, ctx=_ctx()), NextToken)
    # A rule picks DPO with its parameters; a bad one is a plan error naming the field.
    plan = _plan(pm, [{"objective": {"strategy": "dpo", "beta": 0.5, "label_smoothing": 0.1}}])
    dpo = pm.objective(decision=plan.decision("objective"), plan=plan, mesh=None, ctx=_ctx())
    assert (dpo.unit, dpo.params.beta, dpo.params.label_smoothing, dpo.group) == ("pairs", 0.5, 0.1, None)
    with pytest.raises(WeftError, match=r"beta = -1.0 is out of range"):
        _plan(pm, [{"objective": {"strategy": "dpo", "beta": -1.0}}])
    # A third party's objective runs through the core's step like the built-ins.
    plan = _plan(pm, [{"objective": {"strategy": "per_row"}}])
    mine = pm.objective(decision=plan.decision("objective"), plan=plan, mesh=None, ctx=_ctx())
    ids, labels, _ = _pairs()
    model = _model()
    with _one_rank():
        loss_sum, totals = run_micro_batches(model=model, micro_batches=[{"input_ids": ids, "labels": labels}],
                                             split=None, keep_vision=False, autocast=contextlib.nullcontext(),
                                             ctx=_ctx(), objective=mine)
    logp = _by_hand(model, ids, labels)
    lengths = (labels != IGNORE).sum(-1)
    torch.testing.assert_close(loss_sum.double() / totals[0], (-logp / lengths).mean(), rtol=1e-6, atol=0)
    assert int(totals[0]) == 4
    # The built-in plugin declines a strategy it does not own; nobody answering is a HookError.
    import weft.plugins.objective as builtin

    assert builtin.weft_objective(decision=plan.decision("objective"), plan=plan, mesh=None, ctx=_ctx()) is None
    with pytest.raises(HookError, match=r"no plugin answered hook weft_objective for strategy 'nobody'"):
        pm.objective(decision=Decision(point="objective", strategy="nobody", params=NoParams(), source="t", rule="t"),
                     plan=plan, mesh=None, ctx=_ctx())


def _step(model, objective, micro_batch, *, split=None, world: int = 1, rank: int = 0):
    return run_micro_batches(model=model, micro_batches=[micro_batch], split=split, keep_vision=False,
                             autocast=contextlib.nullcontext(), ctx=_ctx(world, rank), objective=objective)


@pytest.mark.parametrize("loss,smoothing,sft", [("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0), ("ipo", 0.0, 0.0),
                                               ("simpo", 0.0, 0.0), ("sigmoid", 0.0, 0.7)])
def test_dpo_step_equals_the_formula(loss, smoothing, sft):
    ids, labels, sequence = _pairs()
    reference_logps = torch.tensor([-40.0, -55.0, -61.0, -30.0], dtype=torch.float64)
    model, hand = _model(), _model()
    params = {"loss": loss, "beta": BETA, "label_smoothing": smoothing, "sft_weight": sft}
    if loss == "simpo":
        params |= {"reference": "none", "gamma": 0.3}
    with _one_rank():
        loss_sum, totals = _step(model, _dpo(**params), _micro_batch(ids, labels, sequence, reference_logps))
    assert float(totals[0]) == 2  # pairs
    pi = _by_hand(hand, ids, labels)
    if loss == "simpo":
        lengths = (labels != IGNORE).sum(-1)
        z = BETA * (pi[0::2] / lengths[0::2] - pi[1::2] / lengths[1::2]) - 0.3
        want = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
    else:
        h = (pi[0::2] - reference_logps[0::2]) - (pi[1::2] - reference_logps[1::2])
        want = ((h - 1 / (2 * BETA)) ** 2 if loss == "ipo"
                else -(1 - smoothing) * F.logsigmoid(BETA * h) - smoothing * F.logsigmoid(-BETA * h))
    # RPO's term: the chosen response's mean token loss, weighted, each pair's
    want = want - sft * pi[0::2] / (labels[0::2] != IGNORE).sum(-1)
    want.mean().backward()
    torch.testing.assert_close(loss_sum / totals[0], want.mean().detach(), rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), hand.parameters()):
        assert p.grad is not None and q.grad.abs().max() > 0, name
        err = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        assert err <= 1e-6, f"{name}: gradient relative error {err:.3g}"


@pytest.mark.parametrize("reference", ["batch", "adapters"])
def test_fused_dpo_equals_the_logits_path(reference):
    """train.loss = "fused" (the head by chunks from the hidden states, never the logits):
    the same loss and gradients as the logits' path, the adapters-off reference too (float64)."""
    from weft.core.train.step import FusedHead

    ids, labels, sequence = _pairs()
    ref = torch.tensor([-40.0, -55.0, -61.0, -30.0], dtype=torch.float64)
    model = _with_lora(_model(), seed=2) if reference == "adapters" else _model()
    twin = copy.deepcopy(model)
    with _one_rank():
        fused = FusedHead(model=model, decoder=model.model)
        loss_sum, totals = run_micro_batches(
            model=model, micro_batches=[_micro_batch(ids, labels, sequence, ref)], split=None, keep_vision=False,
            autocast=contextlib.nullcontext(), ctx=_ctx(), fused=fused, objective=_dpo(reference=reference))
        want, _ = _step(twin, _dpo(reference=reference), _micro_batch(ids, labels, sequence, ref))
    torch.testing.assert_close(loss_sum, want, rtol=1e-10, atol=1e-12)
    assert abs(float(loss_sum / totals[0]) - math.log(2)) > 1e-3  # not the trivial point
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is not None:
            err = ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-30)).item()
            assert err <= 1e-8, f"{name}: gradient relative error {err:.3g}"


def test_dpo_with_the_policy_as_its_reference_is_ln_2():
    ids, labels, sequence = _pairs()
    model = _model()
    with torch.no_grad():
        reference = _by_hand(model, ids, labels)
    with _one_rank():
        loss_sum, totals = _step(model, _dpo(), _micro_batch(ids, labels, sequence, reference))
    assert abs(float(loss_sum / totals[0]) - math.log(2)) < 1e-12
    # The reference missing from the batch is a message naming the key, not a KeyError.
    with _one_rank(), pytest.raises(WeftError, match="no 'weft_reference'"):
        batch = _micro_batch(ids, labels, sequence, reference)
        del batch["weft_reference"]
        _step(model, _dpo(), batch)


def _sp_worker(rank: int, world: int, strategy: str) -> None:
    from distributed import sp_model
    from weft.plugins.objective import Preference, PreferenceParams

    recipe = {**TINY, "parallel": {strategy: world},
              "rules": [{"when": {"modality": "text"}, "attention": {"strategy": strategy}}]}
    model, hand, plan, mesh, split = sp_model(recipe, rank=rank, world=world)
    model, hand = model.double(), hand.double()
    ids, labels, sequence = _pairs(length=23)  # padded by the core to the split's multiple
    reference = torch.tensor([-40.0, -55.0, -61.0, -30.0], dtype=torch.float64)
    objective = Preference(PreferenceParams(beta=BETA, label_smoothing=0.1), group=mesh.sp.get_group())
    loss_sum, totals = _step(model, objective, _micro_batch(ids, labels, sequence, reference), split=split,
                             world=world, rank=rank)
    dist.all_reduce(loss_sum)
    pi = _by_hand(hand, ids, labels)
    h = BETA * ((pi[0::2] - reference[0::2]) - (pi[1::2] - reference[1::2]))
    want = (-0.9 * F.logsigmoid(h) - 0.1 * F.logsigmoid(-h)).mean()
    want.backward()
    torch.testing.assert_close(loss_sum / totals[0], want.detach(), rtol=1e-9, atol=1e-12)
    assert float(totals[0]) == 2 * world  # each rank of the group counts the pairs it shares
    for (name, p), q in zip(model.named_parameters(), hand.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad /= world  # as the gradient reduction averages over the ranks
        err = ((grad - q.grad).abs().max() / q.grad.abs().max()).item()
        assert err <= 1e-6, f"{strategy} {name}: gradient relative error {err:.3g}"


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_dpo_under_sequence_parallelism_equals_one_rank(strategy):
    run_ranks(2, _sp_worker, strategy)


def test_dpo_rule_checks():
    pm = build_plugin_manager(entry_points=False)
    from weft.core.plan.planner import plan_recipe

    for rules, train, message in [
        ([{"objective": {"strategy": "dpo", "loss": "simpo"}}], {}, "simpo takes reference = 'none'"),
        ([{"objective": {"strategy": "dpo", "reference": "none"}}], {}, "sigmoid and ipo take 'batch'"),
        ([{"objective": {"strategy": "dpo", "reference": "adapters"}}], {}, "no rule gives the model an adapter"),
    ]:
        recipe = Recipe.from_dict({**TINY, "rules": rules, "train": train})
        with pytest.raises(WeftError, match=message):
            plan_recipe(recipe, pm=pm, world_size=1, model=copy.deepcopy(_model()))


def _with_lora(model, *, seed: int):
    """``model`` with PEFT LoRA on its attention projections, B drawn (not zero), so the adapted
    model differs from its base."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)  # PEFT draws A from the global generator
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name)
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def test_dpo_with_the_adapters_off_as_reference():
    """reference = 'adapters': the reference is the base (adapters switched off), no second copy:
    the loss and the adapters' gradients equal the formula with the base's log-probabilities
    from a model that never had adapters; every requires_grad flag as it was; with B at zero (the
    adapted model is its base) the loss is ln 2."""
    ids, labels, sequence = _pairs()
    model = _with_lora(_model(), seed=1)
    hand = copy.deepcopy(model)  # the same A (PEFT draws it) and B
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    with _one_rank():
        loss_sum, totals = _step(model, _dpo(reference="adapters"), _micro_batch(ids, labels, sequence, None))
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    with torch.no_grad():
        base = _by_hand(_model(), ids, labels)  # the same seed's weights, never adapted
    pi = _by_hand(hand, ids, labels)
    assert (pi - base).abs().min() > 1e-3  # the adapters change every response's log-probability
    z = BETA * ((pi[0::2] - base[0::2]) - (pi[1::2] - base[1::2]))
    want = -F.logsigmoid(z).mean()
    want.backward()
    torch.testing.assert_close(loss_sum / totals[0], want.detach(), rtol=1e-9, atol=1e-12)
    adapters = [(name, p, q) for (name, p), q in zip(model.named_parameters(), hand.parameters()) if p.requires_grad]
    assert len(adapters) == 2 * 2 * 2  # A and B of q_proj and v_proj in each of the tiny model's 2 layers
    for name, p, q in adapters:
        err = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        assert err <= 1e-6, f"{name}: gradient relative error {err:.3g}"
    zero = _model()
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"]), zero)  # PEFT's init: B = 0
    with _one_rank():
        loss_sum, totals = _step(zero, _dpo(reference="adapters"), _micro_batch(ids, labels, sequence, None))
    assert float(loss_sum / totals[0]) == pytest.approx(math.log(2), abs=1e-12)
    with _one_rank(), pytest.raises(WeftError, match="no adapter layer"):
        _step(_model(), _dpo(reference="adapters"), _micro_batch(ids, labels, sequence, None))


def test_the_fused_head_refuses_an_adapter_on_the_head():
    """PEFT's layer on lm_head answers ``.weight`` with the base's: the fused loss would leave the
    adapter out, silently; it is a message naming train.loss instead."""
    from peft import LoraConfig, inject_adapter_in_model

    from weft.core.train.step import FusedHead

    model = _model()
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["lm_head"]), model)
    with pytest.raises(WeftError, match="adapter a rule puts on the head"):
        FusedHead(model=model, decoder=model.model)


@pytest.mark.parametrize("fused", [False, True])
def test_a_filler_micro_batch_counts_no_pair_and_still_runs_backward(fused):
    """A data-parallel rank's filler (a copy with no label and no pair): zero loss, zero units,
    and a backward through the head and the layers like every rank's (FSDP's collectives)."""
    from weft.core.train.step import FusedHead

    ids, labels, sequence = _pairs()
    batch = {**_micro_batch(ids, torch.full_like(labels, IGNORE), sequence, None), "weft_pairs": torch.tensor(0)}
    model = _model()
    with _one_rank():
        loss_sum, totals = run_micro_batches(
            model=model, micro_batches=[batch], split=None, keep_vision=False, autocast=contextlib.nullcontext(),
            ctx=_ctx(), fused=FusedHead(model=model, decoder=model.model) if fused else None,
            objective=_dpo(reference="none", loss="simpo"))
    assert float(loss_sum) == 0 and float(totals[0]) == 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)
