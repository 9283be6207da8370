"""Activation checkpointing by rule: applied where the rules say, gradients unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from model_helpers import build_model
from weft.core.recipe import Recipe
from weft.strategies.memory.activation_checkpoint import apply_checkpointing


def _loss(model, ids):
    # As weft's step calls it: a key/value cache would grow again in each recomputation.
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


@pytest.mark.parametrize("mode", ["full", "attention", "mlp", "except_attention"])
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


@pytest.mark.quick
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


def _attention_calls_in_backward(mode):
    """How many attention kernels the backward runs again (recomputation), and the gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from weft.strategies.memory.activation_checkpoint import attention_ops

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func in attention_ops()
            return func(*args, **(kwargs or {}))

    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
    for layer in model.model.layers:
        apply_checkpointing(layer, mode=mode)
    with Count():  # the forward's own calls, to prove the kernel is one the policy names
        loss = _loss(model, torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(1)))
    forward, Count.calls = Count.calls, 0
    with Count():
        loss.backward()
    return forward, Count.calls, [p.grad for p in model.parameters()]


@pytest.mark.quick
def test_except_attention_recomputes_all_but_the_attention_kernel():
    """'full' runs each layer's attention kernel again in the backward; 'except_attention' keeps its
    outputs from the forward and runs it once; both give the gradients of no checkpointing."""
    forward, again_full, grads_full = _attention_calls_in_backward("full")
    forward_kept, again_kept, grads_kept = _attention_calls_in_backward("except_attention")
    _, again_off, grads_off = _attention_calls_in_backward("off")
    assert forward == forward_kept == 2  # two layers, one kernel each
    assert (again_off, again_full, again_kept) == (0, 2, 0)
    for got, want in zip(grads_kept, grads_off):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads_full, grads_off):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.quick
def test_except_attention_keeps_the_flash_attn_4_operator():
    """weft's flash-attn-4 path is an operator the policy names (the CuTe kernel itself is opaque)."""
    from weft.strategies.attention.kernels import flash_ops
    from weft.strategies.memory.activation_checkpoint import attention_ops

    assert flash_ops.fa4_forward._opoverload in attention_ops()
    assert torch.ops.weft.fa4_forward.default in attention_ops()


@pytest.mark.quick
def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="accepted: off, full, attention, mlp, except_attention"):
        apply_checkpointing(torch.nn.Linear(2, 2), mode="every")


def test_except_attention_under_fsdp2_and_ring_is_exact(weft, tmp_path):
    """weft check: decoder layers recomputed but for their attention kernel, FSDP2 units over a
    ring of 2 (gloo): the unsharded model's loss and gradients."""
    import json
    import textwrap

    recipe = tmp_path / "r.toml"
    recipe.write_text(textwrap.dedent('''
        [model]
        preset = "qwen2_5_vl_tiny"
        [parallel]
        ring = 2
        [[rules]]
        when = { modality = "text" }
        shard = { strategy = "fsdp2", checkpoint = "except_attention" }
        [[rules]]
        shard = { strategy = "fsdp2" }
    '''))
    done = weft("check", str(recipe), "--world-size", "2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["grad_max_rel_diff"] <= 1e-4, result

