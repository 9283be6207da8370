"""The MLP in tiles of the sequence (shard rule ``mlp_tile_tokens``), alone and with the
layers' inputs offloaded to host memory: the same loss and gradients as the untiled,
non-offloaded step in float64, on one rank and under ring attention over 2 gloo ranks.

Equal to float64 rounding (relative 1e-12), not bit for bit: the MLP weights' gradients
are sums over the tiles (the same products added in another order), and the MLP's input
gradient is computed tile by tile, so a CPU BLAS that blocks a GEMM by its shape (MKL on
AMD EPYC) rounds it differently and the difference flows into every gradient upstream.
No claim holds on one machine only.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_ranks, sharded_text_model
from model_helpers import build_model
from weft.core.recipe import Recipe
from weft.strategies.memory.tiled_mlp import TiledMLP


def _model(rank: int, world: int, *, tile: int, offload: bool, strategy: str):
    shard = {"strategy": strategy, "checkpoint": "full", "offload_activations": offload, "mlp_tile_tokens": tile}
    if strategy == "fsdp2":
        shard = {**shard, "offload_activations": False}  # (offload under FSDP2: tests/test_activation_offload.py)
    return sharded_text_model(shard, rank=rank, world=world)


def _run(model, local, sharded: bool):
    from weft.core.train.loss import targets, token_loss_sum

    logits = model(**{k: v for k, v in local.items() if k not in ("labels", "shift_labels")}, use_cache=False).logits
    loss = token_loss_sum(logits, local["shift_labels"] if sharded else targets(local))
    loss.backward()
    full = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    return loss.detach(), {n: g.clone() for n, g in full.items()}


def _compare(rank: int, world: int, strategy: str) -> None:
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 300, (1, 64)), "attention_mask": torch.ones(1, 64, dtype=torch.long)}
    batch["labels"] = batch["input_ids"].clone()
    from weft.core.train.step import shard_micro_batch

    plain_model, split = _model(rank, world, tile=0, offload=False, strategy=strategy)
    local = shard_micro_batch(batch, split)
    plain, plain_grads = _run(plain_model, local, split is not None)
    for offload in (False, True):
        tiled, tiled_grads = _run(_model(rank, world, tile=7, offload=offload, strategy=strategy)[0], local,
                                  split is not None)
        torch.testing.assert_close(tiled, plain, rtol=1e-12, atol=0, msg=lambda m: f"loss, offload={offload}: {m}")
        for name, grad in plain_grads.items():
            # Tiles change the order of the sums, not the terms: float64 rounding is the bar.
            scale = grad.abs().max().item()
            torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-12, atol=1e-12 * scale,
                                       msg=lambda m, name=name: f"{name}, offload={offload}: {m}")


@pytest.mark.parametrize(("world", "strategy"), [(1, "none"), (2, "none"), (2, "fsdp2")])
def test_tiled_mlp_and_offload_keep_the_loss_and_gradients(world, strategy):
    """Unsharded on one rank and under ring 2; and inside FSDP2 units over the ring's ranks
    (the tiles' backward runs while the unit's weights are gathered)."""
    run_ranks(world, _compare, strategy)


class _Products(TorchDispatchMode):
    """Each matrix product's output shape, in order (a SwiGLU's tiles run F.linear and @, not
    the projections' modules, so module hooks would not see them)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.quick
def test_only_one_tile_of_intermediates_exists_at_a_time():
    """The MLP's widest tensors (tokens x intermediate: 128) are never larger than one tile's."""
    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
    reference = copy.deepcopy(model)
    TiledMLP(tile_tokens=8).attach([layer.mlp for layer in model.model.layers])
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    widest = {}
    for m, name in ((model, "tiled"), (reference, "plain")):
        with _Products() as products:
            m(input_ids=ids, use_cache=False).logits.sum().backward()
        # (tokens, 128): gate, up and their gradient; (64, 128) is the down weight's gradient.
        widest[name] = max(rows for rows, cols in products.shapes if cols == 128 and rows != 64)
    assert widest == {"tiled": 8, "plain": 40}


@pytest.mark.quick
def test_tile_size_is_checked():
    with pytest.raises(ValueError, match="tile_tokens must be at least 1"):
        TiledMLP(tile_tokens=0)


def test_a_4bit_mlp_is_expanded_once_a_pass_and_gives_the_untiled_rows_and_gradients(monkeypatch):
    """NF4 base weights under LoRA: the tiled MLP runs its tiles on weights expanded once per pass
    (forward, backward); its 4-bit weights are back in place after the call. Its rows and
    gradients (by hand, bf16) are as close to float64's as the untiled PEFT module's own (bf16,
    torchao's product per weight): within twice that module's error, or 1% of the largest value."""
    from peft import LoraConfig, inject_adapter_in_model

    from weft.strategies.memory import tiled_mlp
    from weft.strategies.model.quantize import quantize_linears

    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
    mlp = model.model.layers[0].mlp.to(torch.bfloat16)
    quantize_linears(mlp, method="nf4")
    torch.manual_seed(2)  # the adapters' initial values
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                                       init_lora_weights=False), mlp)
    NF4Tensor = type(mlp.gate_proj.base_layer.weight)  # torchao's (its module path moves between releases)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 40, mlp.gate_proj.in_features, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(1, 40, mlp.gate_proj.in_features, dtype=torch.bfloat16, generator=g)
    # float64: PEFT's own forward over the expanded base weights and the adapters, all in float64.
    wide = {n: (p.get_original_weight() if isinstance(p, NF4Tensor) else p.detach()).double().requires_grad_(
        p.requires_grad) for n, p in mlp.named_parameters()}
    x64 = x.double().requires_grad_(True)
    y64 = torch.func.functional_call(mlp, wide, (x64,))
    y64.backward(dy.double())
    exact = {"x": x64.grad, **{n: t.grad for n, t in wide.items() if t.requires_grad}}
    calls, torchao_calls = [], []
    real, real_torchao = tiled_mlp.expanded, NF4Tensor.get_original_weight
    monkeypatch.setattr(tiled_mlp, "expanded", lambda w: calls.append(w.shape) or real(w))
    monkeypatch.setattr(NF4Tensor, "get_original_weight", lambda w: torchao_calls.append(w.shape) or real_torchao(w))
    outputs, grads = [], []
    for tile in (0, 8):  # the same module untiled, then tiled (an NF4 tensor does not deep-copy)
        if tile:
            TiledMLP(tile_tokens=tile).attach([mlp])
            mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        torchao_calls.clear()
        y = mlp(xi)
        y.backward(dy)
        outputs.append(y)
        # Untiled, torchao expands each weight per product: forward, input gradient. Tiled, not at
        # all: the tiles run on weights expanded once a pass, the module's zero-token call on stand-ins.
        assert len(torchao_calls) == (6 if tile == 0 else 0), (tile, torchao_calls)
        grads.append({"x": xi.grad, **{n: p.grad.clone() for n, p in mlp.named_parameters() if p.requires_grad}})
    assert len(calls) == 6  # 3 weights x (forward, backward), none for the untiled module
    assert all(isinstance(m.weight, NF4Tensor) for m in (mlp.gate_proj.base_layer, mlp.down_proj.base_layer))
    assert set(grads[1]) == set(grads[0]) == set(exact) and len(exact) == 7  # x, 3 x (lora_A, lora_B)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.double() - b).abs().max().item()

    for name, ref, peft, by_hand in [("output", y64.detach(), outputs[0], outputs[1])] + [
            (n, exact[n], grads[0][n], grads[1][n]) for n in exact]:
        bar = max(2 * error(peft, ref), 1e-2 * ref.abs().max().item())
        assert error(by_hand, ref) <= bar, (name, error(by_hand, ref), error(peft, ref))


@pytest.mark.quick
@pytest.mark.parametrize("tile", [8, None])
def test_a_recomputed_layer_makes_its_mlp_again_once_without_the_down_product(tile):
    """Under full recomputation the layer's recomputation stops at the MLP's kept input (torch's
    early stop): the MLP's rows are made in the forward and once more in its backward, where the
    gate and up products run again and the down product does not (a compiled MLP under torch's
    checkpoint ran all three: strategies/memory/swiglu.py). In tiles of 8, and as one tile."""
    from weft.strategies.memory.activation_checkpoint import apply_checkpointing

    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}), device="cpu", seed=0)
    layers = model.model.layers
    TiledMLP(tile_tokens=tile).attach([layer.mlp for layer in layers])
    for layer in layers:
        apply_checkpointing(layer, mode="full")
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with _Products() as products:
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    per_layer = {shape: products.shapes.count(shape) / len(layers) for shape in set(products.shapes)}
    # (rows, 128): gate and up in the forward, again in the backward, and h's gradient.
    if tile:  # (8, 64): the down product in the forward, the input's gradient (two products) in the backward
        assert (per_layer[(8, 128)], per_layer[(8, 64)]) == (5 * 5, 3 * 5)
    else:  # (40, 64) is the attention's q and o projections' too: the MLP's gate, up, h's gradient alone
        assert per_layer[(40, 128)] == 5


