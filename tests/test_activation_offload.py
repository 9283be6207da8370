"""Checkpointed units' inputs in host memory between forward and backward (shard rule
``offload_activations = true``): the same loss and bit-identical gradients as the run that
keeps them, on one rank and under ring attention over 2 gloo ranks; the inputs' storage is
really emptied after each unit's forward and refilled for its backward.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks, sharded_text_model


def _model(rank: int, world: int, *, offload: bool):
    return sharded_text_model({"strategy": "none", "checkpoint": "full", "offload_activations": offload},
                              rank=rank, world=world)


def _run(model, local, sharded: bool):
    from weft.core.train.loss import targets, token_loss_sum

    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0] if args else
                                                                                    kwargs["hidden_states"]),
                                             with_kwargs=True) for layer in model.model.layers]
    logits = model(**{k: v for k, v in local.items() if k not in ("labels", "shift_labels")}, use_cache=False).logits
    for hook in hooks:
        hook.remove()
    loss = token_loss_sum(logits, local["shift_labels"] if sharded else targets(local))
    emptied = [x.untyped_storage().nbytes() == 0 for x in seen]
    loss.backward()
    refilled = [x.untyped_storage().nbytes() > 0 for x in seen]
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, emptied, refilled


def _compare(rank: int, world: int) -> None:
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 300, (1, 64)), "attention_mask": torch.ones(1, 64, dtype=torch.long)}
    batch["labels"] = batch["input_ids"].clone()
    from weft.core.train.step import shard_micro_batch

    kept_model, split = _model(rank, world, offload=False)
    local = shard_micro_batch(batch, split)  # the models' own hooks cut their inputs; one cut of the labels
    kept, kept_grads, _, _ = _run(kept_model, local, split is not None)
    moved, moved_grads, emptied, refilled = _run(_model(rank, world, offload=True)[0], local, split is not None)
    assert torch.equal(moved, kept), (moved, kept)
    for name, grad in kept_grads.items():
        assert torch.equal(moved_grads[name], grad), name  # bit for bit: the copies are exact
    # Every layer's input left the device after the layer's forward and came back for backward
    # (layer 0's input is a view of the embedding under the ring split: it stays).
    assert all(emptied[1:]) and all(refilled), (emptied, refilled)


@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_inputs_give_identical_gradients(world):
    run_ranks(world, _compare)


def _released(rank: int, world: int) -> None:
    import weakref

    model, _ = _model(rank, world, offload=True)
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(weakref.ref(
            args[0] if args else kwargs["hidden_states"])), with_kwargs=True)
    batch = {"input_ids": torch.randint(0, 300, (1, 64))}
    for _ in range(2):  # the second step's forward would overwrite what the first left behind
        seen.clear()
        model(**batch, use_cache=False).logits.pow(2).mean().backward()
        # Once backward is done nothing may hold a layer's (restored) input: the checkpoint's
        # recomputation runs the offload's pre-hook but stops before its post-hook, and a
        # reference kept from there held every layer's input on the GPU to the step's end.
        assert seen and all(ref() is None for ref in seen), [ref() is not None for ref in seen]


def test_offload_releases_restored_inputs():
    run_ranks(1, _released)


@pytest.mark.quick
def test_offload_needs_full_checkpointing():
    from weft.core.errors import PlanError
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe

    recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "rules": [
        {"shard": {"strategy": "fsdp2", "checkpoint": "mlp", "offload_activations": True}}]})
    with pytest.raises(PlanError, match="offload_activations = true needs checkpoint = 'full'"):
        plan_recipe(recipe, pm=build_plugin_manager(entry_points=False), world_size=1)
    for shard in ({"strategy": "fsdp2", "checkpoint": "full", "offload_activations": True, "offload_keep_every": 2},
                  {"strategy": "none", "checkpoint": "full", "offload_keep_every": 2}):
        recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "rules": [{"shard": shard}]})
        with pytest.raises(PlanError, match="offload_keep_every = 2 thins the inputs"):
            plan_recipe(recipe, pm=build_plugin_manager(entry_points=False), world_size=1)


def _four_layers() -> str:
    """qwen2_text_tiny with four decoder layers, as a preset file (its absolute path)."""
    import pathlib
    import tempfile

    root = pathlib.Path(__file__).resolve().parents[1]
    text = (root / "recipes" / "presets" / "qwen2_text_tiny.toml").read_text().replace(
        "num_hidden_layers = 2", "num_hidden_layers = 4")
    assert "num_hidden_layers = 4" in text
    path = pathlib.Path(tempfile.mkdtemp()) / "text_tiny_4.toml"
    path.write_text(text)
    return str(path)


def _thinned(rank: int, world: int, every: int, preset: str, runs: list[int]) -> None:
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 300, (1, 64)), "attention_mask": torch.ones(1, 64, dtype=torch.long)}
    batch["labels"] = batch["input_ids"].clone()
    from weft.core.train.step import shard_micro_batch

    rule = {"strategy": "none", "checkpoint": "full"}
    kept_model, split = sharded_text_model(rule, rank=rank, world=world, preset=preset)
    local = shard_micro_batch(batch, split)
    kept, kept_grads, _, _ = _run(kept_model, local, split is not None)
    model, _ = sharded_text_model({**rule, "offload_activations": True, "offload_keep_every": every}, rank=rank,
                                  world=world, preset=preset)
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: calls.__setitem__(i, calls[i] + 1))
    thin, thin_grads, emptied, refilled = _run(model, local, split is not None)
    assert torch.equal(thin, kept), (thin, kept)
    for name, grad in kept_grads.items():
        assert torch.equal(thin_grads[name], grad), name  # bit for bit: the same forward, run again
    assert all(emptied[1:]) and all(refilled), (emptied, refilled)
    # Each layer: its forward, the checkpoint's recomputation, and once more for each layer after
    # it that regenerates its input from it (keep every 2nd: layers 1 and 3; every 3rd: 1 and 2).
    assert calls == runs, calls


@pytest.mark.parametrize("world,every,runs", [(1, 2, [3, 2, 3, 2]), (2, 2, [3, 2, 3, 2]), (1, 3, [3, 3, 2, 2])])
def test_thinned_offload_regenerates_inputs_with_identical_gradients(world, every, runs):
    """offload_keep_every N: only every Nth layer's input goes to the host, the layers between
    regenerate theirs from the layer before in backward (a chain for N = 3): the same loss and
    bit-identical gradients as keeping every input, on one rank and under ring 2."""
    run_ranks(world, _thinned, every, _four_layers(), runs)
