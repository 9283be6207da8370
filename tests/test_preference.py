"""strategies/objective/preference.py: the DPO, IPO and SimPO losses over summed response
log-probabilities against hand-written formulas on a transformers model (float64: loss and every
parameter's gradient), ln 2 with the policy equal to the reference, packed sequences summed into
their own sequence, and the sums over 2 gloo ranks holding halves of each sequence equal to one
rank's, their gradients too."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from distributed import run_ranks
from weft.strategies.objective.preference import IGNORE, preference_loss, sequence_logps, sum_over_group

BETA = 0.1


def _model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).to(torch.float64)


def _pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows chosen 0, rejected 0, chosen 1, rejected 1: a prompt then a response, right-padded;
    labels on the responses only. (ids (4, S), labels (4, S))"""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g) for n in (5, 9)]
    rows, labels = [], []
    for prompt in prompts:
        for n in (4, 7):
            response = torch.randint(1, 64, (n,), generator=g)
            rows.append(torch.cat([prompt, response]))
            labels.append(torch.cat([torch.full_like(prompt, IGNORE), response]))
    width = max(len(r) for r in rows)
    ids = torch.stack([F.pad(r, (0, width - len(r))) for r in rows])
    return ids, torch.stack([F.pad(x, (0, width - len(x)), value=IGNORE) for x in labels])


def _by_hand(model, ids, labels) -> torch.Tensor:
    """Each row's summed log-probability of its labels, the textbook way. (4,)"""
    logp = model(ids).logits[:, :-1].log_softmax(-1)
    picked = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1)
    return (picked * (labels[:, 1:] != IGNORE)).sum(-1)


def _weft(model, ids, labels) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
    sequence = torch.arange(len(ids))[:, None].expand_as(ids)
    return sequence_logps(model(ids).logits, target, sequence, sequences=len(ids), chunk_rows=5)


@pytest.mark.parametrize("kind,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("simpo", 0.0)])
def test_loss_and_gradients_equal_the_formula(kind, smoothing):
    policy, reference = _model(0), _model(1)
    ids, labels = _pairs()
    with torch.no_grad():
        ref = _by_hand(reference, ids, labels)
    tokens = (labels != IGNORE).sum(-1)
    pc, pr = _by_hand(policy, ids, labels)[0::2], _by_hand(policy, ids, labels)[1::2]
    if kind == "sigmoid":
        z = BETA * ((pc - ref[0::2]) - (pr - ref[1::2]))
        expected = (-(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)).mean()
    elif kind == "ipo":
        expected = (((pc - ref[0::2]) - (pr - ref[1::2]) - 1 / (2 * BETA)) ** 2).mean()
    else:
        z = BETA * (pc / tokens[0::2] - pr / tokens[1::2]) - 0.5
        expected = -F.logsigmoid(z).mean()
    want = torch.autograd.grad(expected, list(policy.parameters()))

    sums, counts = _weft(policy, ids, labels)
    assert counts.tolist() == tokens.tolist()
    terms = preference_loss(kind=kind, chosen=sums[0::2], rejected=sums[1::2], ref_chosen=ref[0::2],
                            ref_rejected=ref[1::2], beta=BETA, label_smoothing=smoothing,
                            chosen_tokens=counts[0::2], rejected_tokens=counts[1::2], gamma=0.5)
    got = torch.autograd.grad(terms.loss.mean(), list(policy.parameters()))
    assert abs(terms.loss.mean().item() - expected.item()) < 1e-6
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert terms.margin.shape == (2,) and set(terms.accuracy.tolist()) <= {0.0, 1.0}


def test_policy_equal_to_reference_gives_ln_2():
    policy = _model(0)
    reference = copy.deepcopy(policy)
    ids, labels = _pairs()
    sums, _ = _weft(policy, ids, labels)
    with torch.no_grad():
        ref, _ = _weft(reference, ids, labels)
    terms = preference_loss(kind="sigmoid", chosen=sums[0::2], rejected=sums[1::2], ref_chosen=ref[0::2],
                            ref_rejected=ref[1::2], beta=BETA)
    assert terms.loss.mean().item() == math.log(2)
    assert terms.margin.abs().max().item() == 0.0


def test_packed_sequences_sum_into_their_own():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 10, 16, dtype=torch.float64, generator=g)
    target = torch.randint(0, 16, (2, 10), generator=g)
    target[:, :3] = IGNORE
    rows, _ = sequence_logps(logits, target, torch.arange(2)[:, None].expand(2, 10), sequences=2)
    # The same positions as one packed row: the second sequence after the first.
    packed, counts = sequence_logps(logits.reshape(1, 20, 16), target.reshape(1, 20),
                                    torch.arange(2).repeat_interleave(10)[None], sequences=2, chunk_rows=3)
    torch.testing.assert_close(packed, rows, rtol=0, atol=1e-12)
    assert counts.tolist() == [7, 7]


def _halves(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, 16, dtype=torch.float64, generator=g)
    target = torch.randint(0, 16, (4, 12), generator=g)
    target[:, :4] = IGNORE
    ref = torch.randn(4, dtype=torch.float64, generator=g)
    sequence = torch.arange(4)[:, None].expand(4, 12)

    def loss(x, t, s, group):
        sums, _ = sequence_logps(x, t, s, sequences=4)
        sums = sum_over_group(sums, group)
        return preference_loss(kind="sigmoid", chosen=sums[0::2], rejected=sums[1::2], ref_chosen=ref[0::2],
                               ref_rejected=ref[1::2], beta=BETA).loss.mean()

    whole = logits.clone().requires_grad_()
    one = loss(whole, target, sequence, None)
    one.backward()
    # This rank's positions: a zigzag half of each row (chunks r and 2w-1-r), as the ring lays them out.
    chunks = torch.arange(12).chunk(2 * world)
    mine = torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
    part = logits[:, mine].clone().requires_grad_()
    got = loss(part, target[:, mine], sequence[:, mine], torch.distributed.group.WORLD)
    got.backward()
    assert abs(got.item() - one.item()) < 1e-12
    # Every rank computes the same loss from the same sums: each position's gradient arrives world times.
    torch.testing.assert_close(part.grad / world, whole.grad[:, mine], rtol=0, atol=1e-12)


def test_sums_over_two_ranks_equal_one_rank():
    run_ranks(2, _halves)
