"""Objective hook: what a step minimises, chosen by the root's ``objective`` rule.

``sft`` (the default): the next-token loss over the labels (core/train/step.py's
``NextToken``; ``train.loss`` picks logits or the fused head). ``dpo``: a preference loss over
pairs of whole responses (strategies/objective/preference.py: DPO's sigmoid loss with label
smoothing, IPO, SimPO), from each response's summed log-probabilities.

A preference micro-batch carries, besides the model's inputs and the labels (the responses'
tokens labelled, the prompts not):

- ``weft_sequence`` (B, S) long: the response each token belongs to, ``2p`` for pair p's
  chosen one and ``2p + 1`` for its rejected one (any value where the label is -100);
- ``weft_pairs`` (): the micro-batch's pairs, P;
- ``weft_reference`` (2P,): the reference model's summed log-probability of each response, in
  the same order (``reference = "batch"``: computed once, before training, and carried with
  the data; SimPO needs none).

Both responses of a pair sit in one micro-batch, so they are scored by the same weights in
the same forward. Under ring or Ulysses each rank holds a part of every response: the core
shifts and cuts ``weft_sequence`` like the labels, each rank sums its own positions, and a
differentiable all-reduce over ``mesh.sp`` gives every rank the whole sums (the pairs are
counted on every rank of the group, so the group's repeats cancel in the step's mean).
"""

from __future__ import annotations

from typing import Literal

import attrs

from weft.core.errors import WeftError
from weft.core.hookspecs import hookimpl
from weft.core.recipe.convert import in_range
from weft.core.registry import Declared, NoParams, Objective, Strategy

SEQUENCE, PAIRS, REFERENCE = "weft_sequence", "weft_pairs", "weft_reference"


@attrs.frozen(kw_only=True)
class PreferenceParams:
    loss: Literal["sigmoid", "ipo", "simpo"] = attrs.field(default="sigmoid", metadata={
        "doc": "sigmoid: DPO; ipo: IPO's squared loss on summed log-ratios; simpo: SimPO (per-token "
               "log-probabilities, no reference)"})
    beta: float = attrs.field(default=0.1, validator=in_range(low=1e-6), metadata={
        "doc": "the reward's scale: beta (log pi - log ref); IPO's target margin is 1 / (2 beta)"})
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(low=0.0, high=0.49), metadata={
        "doc": "the probability that a pair's preference is flipped (conservative DPO); sigmoid and simpo"})
    gamma: float = attrs.field(default=0.0, validator=in_range(low=0.0), metadata={
        "doc": "SimPO's target reward margin"})
    sft_weight: float = attrs.field(default=0.0, validator=in_range(low=0.0), metadata={
        "doc": "adds this times the chosen response's mean token loss to each pair's (RPO; TRL's rpo_alpha, "
               "LLaMA-Factory's pref_ftx): the chosen response pulled up, not only the rejected one pushed down"})
    reference: Literal["batch", "adapters", "none"] = attrs.field(default="batch", metadata={
        "doc": "batch: the reference log-probabilities come with the data (weft_reference); adapters: the "
               "model with its LoRA adapters switched off (no second copy: one more forward, without "
               "gradients, a micro-batch); none: no reference (simpo)"})


def _reference_check(params: PreferenceParams, *, recipe, plan) -> str | None:
    if (params.loss == "simpo") != (params.reference == "none"):
        return (f"objective dpo: loss = {params.loss!r} with reference = {params.reference!r}; simpo takes "
                f"reference = 'none', sigmoid and ipo take 'batch' (the reference log-probabilities with the data) "
                f"or 'adapters' (the base under LoRA)")
    if params.reference == "adapters" and not any(
            not plan.strategy(unit.get("adapter")).inert for unit in plan.modules_for("adapter")):
        return ("objective dpo: reference = 'adapters' is the model with its adapters switched off, and no rule "
                "gives the model an adapter; add an adapter rule (adapter = { strategy = \"lora\" }) or use "
                "reference = 'batch' (the reference log-probabilities with the data)")
    return None


class Preference(Objective):
    """The pairs' loss, summed; the step divides by the global pair count."""

    token_keys = (SEQUENCE,)
    batch_keys = (PAIRS, REFERENCE)
    unit = "pairs"

    def __init__(self, params: PreferenceParams, *, group) -> None:
        self.params = params
        self.group = group  # the sequence-parallel ranks, or None
        self.sums: dict = {}

    def begin_step(self) -> None:
        self.sums = {}

    def step_stats(self) -> dict:
        """Each a sum over this step's pairs: the rewards of the chosen and of the rejected
        responses, their margin, the share of pairs whose chosen response wins, and the two
        responses' summed log-probabilities under the policy."""
        return dict(self.sums)

    def units(self, batch: dict, target):
        if PAIRS not in batch or SEQUENCE not in batch:
            raise WeftError(f"objective dpo: a micro-batch without {PAIRS!r} and {SEQUENCE!r}; preference data "
                            f"(prompt, chosen, rejected) gives them (docs/data.md)", where="objective")
        return batch[PAIRS].double()

    def loss_sum(self, *, model, batch, target, fused, extra):
        from weft.strategies.objective.preference import preference_loss

        pairs = int(extra[PAIRS])
        reference = extra.get(REFERENCE)
        if self.params.reference == "adapters":
            # The base's forward first: its logits are gone before the policy's activations are kept.
            reference = self._base_logps(model=model, batch=batch, target=target, sequence=extra[SEQUENCE],
                                         sequences=2 * pairs, fused=fused)
        elif self.params.reference == "batch" and reference is None:
            raise WeftError(f"objective dpo with reference = 'batch': the micro-batch has no {REFERENCE!r} (the "
                            f"reference model's log-probabilities of each response)", where="objective")
        logps, tokens = self._response_logps(model=model, batch=batch, target=target, sequence=extra[SEQUENCE],
                                             sequences=2 * pairs, fused=fused)  # (2P,) each
        ref = reference.to(logps.dtype) if reference is not None else None
        terms = preference_loss(
            kind=self.params.loss, chosen=logps[0::2], rejected=logps[1::2],
            ref_chosen=None if ref is None else ref[0::2], ref_rejected=None if ref is None else ref[1::2],
            beta=self.params.beta, label_smoothing=self.params.label_smoothing, chosen_tokens=tokens[0::2],
            rejected_tokens=tokens[1::2], gamma=self.params.gamma, sft_weight=self.params.sft_weight)
        for name, value in (("reward_chosen", terms.chosen_reward), ("reward_rejected", terms.rejected_reward),
                            ("reward_margin", terms.margin), ("preference_accuracy", terms.accuracy),
                            ("logps_chosen", logps[0::2]), ("logps_rejected", logps[1::2])):
            self.sums[name] = self.sums.get(name, 0.0) + value.detach().sum()
        return terms.loss.sum()

    def _base_logps(self, *, model, batch, target, sequence, sequences: int, fused=None):
        """The responses' summed log-probabilities under the base (adapters off), no gradient. (2P,)"""
        import torch

        from weft.strategies.model.adapters_off import adapter_layers, adapters_off

        if not adapter_layers(model):
            raise WeftError("objective dpo with reference = 'adapters': the model has no adapter layer to switch "
                            "off (an adapter rule, adapter = { strategy = \"lora\" }, gives it some)",
                            where="objective")
        with torch.no_grad(), adapters_off(model):
            return self._response_logps(model=model, batch=batch, target=target, sequence=sequence,
                                        sequences=sequences, fused=fused)[0]

    def _response_logps(self, *, model, batch, target, sequence, sequences: int, fused):
        """(summed log-probabilities (N,), label tokens (N,)) of the micro-batch's ``sequences``
        responses, whole over the sequence-parallel group: from the fused head by chunks
        (``train.loss = "fused"``), else from the logits of the responses' positions only."""
        from weft.strategies.objective.preference import response_positions, sequence_logps, sum_over_group

        if fused is not None:
            logps, tokens = _fused_logps(fused, batch, target, sequence, sequences=sequences)
        else:
            keep, target_kept, sequence_kept = response_positions(target, sequence)
            logits = model(**batch, use_cache=False, logits_to_keep=keep).logits  # (B, K, V)
            logps, tokens = sequence_logps(logits, target_kept, sequence_kept, sequences=sequences)
            del logits
        return sum_over_group(logps, self.group), sum_over_group(tokens, self.group)


def _fused_logps(fused, batch, target, sequence, *, sequences: int):
    """(summed log-probabilities (N,), label tokens (N,)) of the ``sequences`` responses from the
    decoder's hidden states and the head's weight, never the logits of more than a chunk of rows
    (core/train/fused_loss.py): each response's own labelled rows, one call each, so every row is
    computed once. A response with no token on this rank (a ring rank's part) still makes a
    call, on one unlabelled row, so the head and the hidden states reach the backward on every
    rank."""
    import torch

    from weft.core.train.fused_loss import linear_cross_entropy_sum
    from weft.strategies.objective.preference import IGNORE

    hidden, head = fused.forward(batch)  # (B, S_local, H)
    flat, t, s = hidden.flatten(0, 1), target.flatten(), sequence.flatten()
    if not sequences:  # a filler micro-batch (no pair): still through the head, for the backward
        tie = linear_cross_entropy_sum(flat[:1], head.weight, torch.full_like(t[:1], IGNORE), bias=head.bias)
        return tie.reshape(1)[:0], torch.zeros(0, dtype=torch.long, device=flat.device)
    sums, counts = [], []
    for k in range(sequences):
        rows = ((t != IGNORE) & (s == k)).nonzero()[:, 0]  # (R,)
        labels = t[rows] if len(rows) else torch.full_like(t[:1], IGNORE)
        rows = rows if len(rows) else rows.new_zeros(1)
        sums.append(-linear_cross_entropy_sum(flat[rows], head.weight, labels, bias=head.bias))
        counts.append(int((labels != IGNORE).sum()))
    return torch.stack(sums), torch.tensor(counts, device=flat.device)


def _reference_seconds(params: PreferenceParams, *, units, shape, setup, gpu) -> dict:
    """`weft plan --estimate`: reference = 'adapters' runs the model's forward once more a
    micro-batch, without gradients and with the adapters off."""
    from weft.core.plan.step_time import forward_seconds

    return {"reference forward": forward_seconds(units, shape, setup, gpu)} if params.reference == "adapters" else {}


def _next_token(params, *, plan, mesh, ctx):
    from weft.core.train.step import NextToken

    return NextToken()


def _preference(params, *, plan, mesh, ctx):
    group = mesh.sp.get_group() if mesh is not None and plan.mesh.sp > 1 else None
    return Preference(params, group=group)


STRATEGIES = Declared(
    Strategy(point="objective", name="sft", params=NoParams, impl=_next_token,
             summary="next-token cross-entropy over the labels, the mean over the step's label tokens"),
    Strategy(point="objective", name="dpo", params=PreferenceParams, impl=_preference, check=_reference_check,
             estimate_time=_reference_seconds,
             summary="preference loss (DPO sigmoid, IPO, SimPO) over pairs of whole responses, the mean over pairs"),
)


@hookimpl
def weft_strategies():
    return STRATEGIES.list()


@hookimpl
def weft_objective(decision, plan, mesh, ctx):
    return STRATEGIES.answer(decision, plan=plan, mesh=mesh, ctx=ctx)
