"""Activation checkpointing by rule: applied where the rules say, gradients unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from model_helpers import build_model
from weft.core.recipe import Recipe
from weft.strategies.activation_checkpoint import apply_checkpointing


def _loss(model, ids):
    return model(input_ids=ids).logits.float().pow(2).mean()


@pytest.mark.parametrize("mode", ["full", "attention", "mlp"])
def test_checkpointing_keeps_gradients(mode):
    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
    reference = copy.deepcopy(model)
    counts = [apply_checkpointing(layer, mode=mode) for layer in model.model.layers]
    assert counts == [1, 1]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    _loss(model, ids).backward()
    _loss(reference, ids).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    # Names are unchanged (no wrapper class): checkpoints and exports stay compatible.
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]


def test_checkpointing_saves_fewer_activations():
    def saved_tensors(mode):
        model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
        for layer in model.model.layers:
            apply_checkpointing(layer, mode=mode)
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(t.numel()) or t, lambda t: t):
            loss = _loss(model, torch.randint(0, 300, (1, 32)))
        loss.backward()
        return sum(count)

    off, full, mlp = saved_tensors("off"), saved_tensors("full"), saved_tensors("mlp")
    assert full < mlp < off


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="accepted: off, full, attention, mlp"):
        apply_checkpointing(torch.nn.Linear(2, 2), mode="every")
