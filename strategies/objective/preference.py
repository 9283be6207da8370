"""Preference objectives over whole responses: DPO (Rafailov et al., 2023; the sigmoid loss
with conservative label smoothing), IPO (Azar et al., 2023) and SimPO (Meng et al., 2024).

Each compares *summed* log-probabilities of a chosen and a rejected response to one prompt.
Where a response lives on several ranks (ring, Ulysses: each rank holds a part of the
sequence) or beside other documents (packing), a sum is exact only if every position is
counted once, in its own sequence: :func:`sequence_logps` sums a rank's positions into their
sequences (a position's sequence given, not guessed from rows), and :func:`sum_over_group`
adds the ranks' partial sums with a differentiable all-reduce, so the loss is the same on
every rank of the group and each rank's gradient reaches only its own positions' logits.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100
Kind = Literal["sigmoid", "ipo", "simpo"]


def sequence_logps(logits: torch.Tensor, target: torch.Tensor, sequence: torch.Tensor, *, sequences: int,
                   chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probabilities (N,), label tokens (N,)) of ``sequences`` sequences.

    logits (B, S, V); target (B, S): the token each position predicts, IGNORE where none (the
    prompt, padding); sequence (B, S): the sequence each position's target belongs to (0 to
    N-1; ignored where target is IGNORE). The log-softmax is taken in float32 at least (float64
    logits stay float64), ``chunk_rows`` positions at a time, and only at labelled positions.
    """
    flat, t, s = logits.flatten(0, 1), target.flatten(), sequence.flatten()
    rows = (t != IGNORE).nonzero()[:, 0]  # (K,) labelled positions
    acc = torch.promote_types(logits.dtype, torch.float32)
    # Tied to the logits even where this rank holds no labelled position (a ring rank's part
    # may be all prompt): every rank of the group then backpropagates through the all-reduce.
    sums = torch.zeros(sequences, dtype=acc, device=logits.device) + flat[:0].sum().to(acc)
    for start in range(0, len(rows), chunk_rows):
        at = rows[start:start + chunk_rows]
        x = flat[at].to(acc)  # (C, V)
        picked = x.gather(1, t[at][:, None]).squeeze(1) - torch.logsumexp(x, dim=-1)  # (C,)
        sums = sums.index_add(0, s[at], picked)
    counts = torch.zeros(sequences, dtype=torch.long, device=logits.device).index_add(
        0, s[rows], torch.ones_like(rows))
    return sums, counts


def response_positions(target: torch.Tensor, sequence: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The positions whose logits a preference loss reads: (keep (K,), target (B, K), sequence
    (B, K)). keep: the positions labelled in any row (the responses'), for the model's
    ``logits_to_keep``, so the (B, S, V) logits of the prompts never exist (at 32K tokens and
    152K words, 10 GiB in bf16); one unlabelled position where none is (a ring rank holding
    only prompt), so every rank still runs the head and its backward."""
    keep = (target != IGNORE).any(0).nonzero()[:, 0]  # (K,)
    if not len(keep):
        keep = torch.zeros(1, dtype=torch.long, device=target.device)
    return keep, target[:, keep], sequence[:, keep]


def sum_over_group(partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of every rank's ``partial`` over ``group`` (None: this rank's alone), with a
    gradient: backward hands each rank the sum of the ranks' gradients of the total, which,
    since every rank computes the same loss from the same total, is the group's size times
    the one-rank gradient (:func:`preference_loss`'s callers divide by it)."""
    if group is None or dist.get_world_size(group) == 1:
        return partial
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(partial, group=group)


@attrs.frozen(kw_only=True)
class PreferenceTerms:
    """A batch of pairs' loss and what `weft report` shows of it, each (P,)."""

    loss: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor

    @property
    def margin(self) -> torch.Tensor:
        return self.chosen_reward - self.rejected_reward

    @property
    def accuracy(self) -> torch.Tensor:
        """1 where the chosen response's reward is the higher."""
        return (self.margin > 0).to(self.loss.dtype)


def preference_loss(*, kind: Kind, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                    ref_rejected: torch.Tensor | None, beta: float, label_smoothing: float = 0.0,
                    chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None,
                    gamma: float = 0.0, sft_weight: float = 0.0) -> PreferenceTerms:
    """Each pair's loss from its summed log-probabilities (P,) under the policy and the reference.

    - ``sigmoid`` (DPO): z = beta ((pi_c - ref_c) - (pi_r - ref_r)),
      loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z), eps = ``label_smoothing``;
      rewards beta (pi - ref). With the policy equal to the reference, z = 0: loss ln 2.
    - ``ipo``: h = (pi_c - ref_c) - (pi_r - ref_r), loss = (h - 1 / (2 beta))^2 (the paper's
      sums; TRL's ``ipo`` averages over tokens instead).
    - ``simpo``: no reference; z = beta (pi_c / |c| - pi_r / |r|) - gamma (lengths in label
      tokens), the sigmoid loss of z; rewards beta pi / |.|.

    ``sft_weight`` w > 0 adds w times the chosen response's mean token loss, ``-pi_c / |c|``, to
    each pair's loss (RPO, Pang et al. 2024: TRL's ``rpo_alpha``, LLaMA-Factory's ``pref_ftx``):
    the preference alone may be met by pushing the rejected response down, this term also pulls
    the chosen one up, so that it is what the model says.
    """
    terms = _preference_terms(kind=kind, chosen=chosen, rejected=rejected, ref_chosen=ref_chosen,
                              ref_rejected=ref_rejected, beta=beta, label_smoothing=label_smoothing,
                              chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens, gamma=gamma)
    if sft_weight == 0:
        return terms
    if chosen_tokens is None:
        raise ValueError("sft_weight needs chosen_tokens (the chosen response's mean token loss)")
    nll = -chosen / chosen_tokens.clamp(min=1)  # (P,)
    return attrs.evolve(terms, loss=terms.loss + sft_weight * nll)


def _preference_terms(*, kind: Kind, chosen, rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float,
                      chosen_tokens, rejected_tokens, gamma: float) -> PreferenceTerms:
    """The preference loss alone (:func:`preference_loss`)."""
    if kind == "simpo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("simpo needs chosen_tokens and rejected_tokens (its log-probabilities are per token)")
        good = beta * chosen / chosen_tokens.clamp(min=1)
        bad = beta * rejected / rejected_tokens.clamp(min=1)
        z = good - bad - gamma
        loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
        return PreferenceTerms(loss=loss, chosen_reward=good.detach(), rejected_reward=bad.detach())
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"{kind} needs the reference model's log-probabilities (ref_chosen, ref_rejected)")
    good, bad = chosen - ref_chosen, rejected - ref_rejected
    if kind == "sigmoid":
        z = beta * (good - bad)
        loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif kind == "ipo":
        loss = (good - bad - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"preference loss {kind!r}: sigmoid, ipo or simpo")
    return PreferenceTerms(loss=loss, chosen_reward=beta * good.detach(), rejected_reward=beta * bad.detach())
