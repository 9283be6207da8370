"""A SwiGLU MLP by hand (strategies/memory/swiglu.py) as a recomputed MLP runs it: the module's
rows and autograd's gradients, in float64; the modules it takes and the ones it leaves to their
own forward; a bf16 autocast over float32 weights in its backward as in its forward."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2MLP
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

from weft.strategies.memory.swiglu import is_swiglu
from weft.strategies.memory.tiled_mlp import TiledMLP

CONFIG = Qwen2Config(hidden_size=24, intermediate_size=40, hidden_act="silu")


def _mlp(*, bias: bool = False, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return (Qwen2_5_VLMLP(CONFIG, bias=True) if bias else Qwen2MLP(CONFIG)).to(dtype)


def _grads(mlp, x, dy):
    xi = x.clone().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    y = mlp(xi)
    y.backward(dy)
    return y.detach(), {"x": xi.grad, **{n: p.grad for n, p in mlp.named_parameters() if p.grad is not None}}


@pytest.mark.quick
@pytest.mark.parametrize(("bias", "tile", "shape"), [(False, None, (2, 9)), (True, None, (13,)), (False, 4, (2, 9)),
                                                     (True, 5, (13,))])
def test_by_hand_gives_the_modules_rows_and_autograds_gradients(bias, tile, shape):
    """Batched (B, S, H) and vision-like (S, H) inputs, one tile or several, with and without
    biases; the gate weight frozen in one case: no gradient for it, the others' unchanged."""
    mlp = _mlp(bias=bias)
    reference = _mlp(bias=bias)
    if bias:
        for m in (mlp, reference):
            m.gate_proj.weight.requires_grad_(False)
    x = torch.randn(*shape, 24, dtype=torch.float64)
    dy = torch.randn(*shape, 24, dtype=torch.float64)
    TiledMLP(tile_tokens=tile).attach([mlp])
    y, grads = _grads(mlp, x, dy)
    ref_y, ref_grads = _grads(reference, x, dy)
    torch.testing.assert_close(y, ref_y, rtol=1e-13, atol=1e-13)
    assert grads.keys() == ref_grads.keys() and ("gate_proj.weight" in grads) is not bias
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.quick
def test_under_bf16_autocast_the_backward_uses_the_forwards_precision():
    """float32 weights, bf16 autocast: the backward's products run in bf16 as the forward's did
    (torch's checkpoint restores autocast for its recomputation; so does the MLP's backward),
    and the gradients come back in the weights' float32."""
    mlp, reference = _mlp(dtype=torch.float32), _mlp(dtype=torch.float32)
    TiledMLP(tile_tokens=None).attach([mlp])
    x, dy = torch.randn(2, 9, 24), torch.randn(2, 9, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads = _grads(mlp, x, dy)
        ref_y, ref_grads = _grads(reference, x, dy)
    assert y.dtype == ref_y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref_y, rtol=2e-2, atol=2e-2)
    for name, g in ref_grads.items():
        assert grads[name].dtype == g.dtype, name
        # bf16 products either way (float32 products would sit ~100x closer to a float64 reference,
        # and the bf16 rounding of silu(g) before the product, eager's, is not done by hand).
        torch.testing.assert_close(grads[name], g, rtol=5e-2, atol=5e-2 * g.abs().max().item(), msg=name)


def _lora(mlp: torch.nn.Module, **config) -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(1)
    inject_adapter_in_model(LoraConfig(r=3, lora_alpha=5, target_modules=["gate_proj", "up_proj", "down_proj"],
                                       init_lora_weights=False, **config), mlp)
    return mlp.to(torch.float64)


@pytest.mark.quick
@pytest.mark.parametrize("tile", [None, 4])
def test_lora_by_hand_gives_peft_rows_and_gradients_and_follows_its_switch(tile):
    """PEFT's LoRA on all three projections: the adapter's product added into the base's by one
    matrix product, its gradients by hand, in float64 equal to PEFT's forward under autograd; the
    base frozen (no gradient). With the adapters switched off (a DPO reference pass) the base
    alone, as PEFT computes it then."""
    from weft.strategies.model.adapters_off import adapters_off

    mlp, reference = _lora(_mlp()), _lora(_mlp())
    for m in (mlp, reference):
        for name, p in m.named_parameters():
            p.requires_grad_("lora_" in name)
    x, dy = torch.randn(2, 9, 24, dtype=torch.float64), torch.randn(2, 9, 24, dtype=torch.float64)
    TiledMLP(tile_tokens=tile).attach([mlp])
    y, grads = _grads(mlp, x, dy)
    ref_y, ref_grads = _grads(reference, x, dy)
    torch.testing.assert_close(y, ref_y, rtol=1e-13, atol=1e-13)
    assert grads.keys() == ref_grads.keys() and len(grads) == 7  # x, 3 x (A, B)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-12, atol=1e-12, msg=name)
    with adapters_off(mlp), adapters_off(reference):
        off, ref_off = mlp(x), reference(x)
    torch.testing.assert_close(off, ref_off, rtol=1e-13, atol=1e-13)
    assert (off - y).abs().max() > 1e-3  # the adapters did add something


@pytest.mark.quick
def test_only_swiglu_mlps_this_file_runs_are_taken():
    """DoRA, an adapter's dropout, a hook on a projection or another activation keep the
    module's own forward (a whole-sequence tile is refused for them)."""
    assert is_swiglu(_mlp()) and is_swiglu(_mlp(bias=True)) and is_swiglu(_lora(_mlp()))
    dora, dropout = _lora(_mlp(), use_dora=True), _lora(_mlp(), lora_dropout=0.1)
    hooked = _mlp()
    hooked.up_proj.register_forward_hook(lambda m, a, o: None)
    gelu = Qwen2MLP(Qwen2Config(hidden_size=24, intermediate_size=40, hidden_act="gelu"))
    assert not any(is_swiglu(m) for m in (dora, dropout, hooked, gelu, torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="one whole-sequence tile is for SwiGLU MLPs"):
        TiledMLP(tile_tokens=None).attach([dora])
