"""A 4-bit frozen base by rule (`shard = { quantize = "nf4" }`, torchao's NF4) under LoRA:
materialised unit by unit, `weft check` exact against an unsharded reference holding the
same 4-bit codes, checkpoints that hold only the adapters, resume and export."""

from __future__ import annotations

import json

import pytest
import torch

from test_lora import LORA, _tiny

pytest.importorskip("torchao")

QLORA = (LORA.replace('r = 4, alpha = 8, dropout = 0.0, targets = ["q_proj", "v_proj"] }',
                      'r = 4, alpha = 8, targets = "all-linear", b_init = "normal" }')
         + '[[rules]]\nname = "4-bit text layers"\nwhen = { path = "*.language_model.layers.*" }\n'
         'shard = { strategy = "none", quantize = "nf4", checkpoint = "full" }\n'
         '[[rules]]\nname = "everything else whole"\nshard = { strategy = "none" }\n')


def _write(tmp_path, text: str = QLORA):
    return _tiny(tmp_path, text, name="q.toml")


def _plan(recipe):
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(entry_points=False)
    return plan_recipe(recipe, pm=pm, world_size=1)[0], pm


@pytest.mark.quick
def test_units_materialised_one_by_one_hold_the_codes_of_the_whole_model_quantised(tmp_path):
    """The streaming path (each layer filled and quantised before the next exists) against the
    whole model drawn then quantised: identical codes and identical other weights."""
    from weft.plugins.models.build import quantize_units

    recipe = _write(tmp_path)
    plan, pm = _plan(recipe)
    quantize = plan.quantized_units()
    assert quantize == {"model.language_model.layers.0": "nf4", "model.language_model.layers.1": "nf4"}
    family = pm.models.for_recipe(recipe)
    streamed = family.build(recipe, device="cpu", seed=5, quantize=quantize)
    whole = family.build(recipe, device="cpu", seed=5)
    quantize_units(whole, quantize)
    a, b = dict(streamed.named_parameters()), dict(whole.named_parameters())
    assert a.keys() == b.keys()
    four_bit = [n for n, p in a.items() if type(p).__name__ == "NF4Tensor"]
    assert len(four_bit) == 14  # 7 linear layers (q, k, v, o, gate, up, down) in each of 2 layers
    for name in a:
        x, y = a[name], b[name]
        if name in four_bit:
            assert torch.equal(x.quantized_data, y.quantized_data) and torch.equal(x.get_original_weight(),
                                                                                    y.get_original_weight())
        else:
            assert torch.equal(x, y), name
    # 4 bits: the layers' linear weights hold ~1/7 of their float32 bytes (codes and scalers).
    from weft.strategies.model.quantize import stored_bytes

    assert sum(stored_bytes(a[n]) for n in four_bit) < 0.15 * sum(a[n].numel() * 4 for n in four_bit)


def test_check_is_exact_with_a_4bit_base_under_ring2_and_dp2(weft, tmp_path):
    """Both sides hold the same 4-bit codes: the plan's loss and adapter gradients equal the
    reference's; the loss is not the full-precision base's (the codes are in use)."""
    _write(tmp_path)
    results = {}
    for mesh in ("parallel.ring=2", "parallel.dp_shard=2"):
        done = weft("check", "q.toml", "--world-size", "2", "--set", mesh, "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        results[mesh] = result = json.loads(done.stdout)
        assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4
        assert result["grad_params"] == {"reference": 28, "plan": 28}  # the adapters only
    # Composed with what a long 4-bit run needs: the layers' inputs in host memory, their MLPs
    # tiled, the fused loss.
    _write(tmp_path, QLORA.replace('checkpoint = "full" }', 'checkpoint = "full", offload_activations = true, '
                                   'mlp_tile_tokens = 256 }').replace('precision = "fp32"', 'precision = "fp32"\n'
                                                                       'loss = "fused"'))
    done = weft("check", "q.toml", "--world-size", "2", "--set", "parallel.ring=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    composed = json.loads(done.stdout)
    assert composed["ok"] and composed["loss_rel_diff"] <= 1e-5 and composed["grad_max_rel_diff"] <= 1e-4
    _write(tmp_path, QLORA.replace('quantize = "nf4", ', ""))
    done = weft("check", "q.toml", "--world-size", "2", "--set", "parallel.ring=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    full = json.loads(done.stdout)
    assert abs(full["loss_ref"] - results["parallel.ring=2"]["loss_ref"]) > 1e-4 * abs(full["loss_ref"])


def test_a_4bit_base_is_refused_where_nothing_freezes_it(weft, tmp_path):
    _write(tmp_path, QLORA.replace('adapter = { strategy = "lora", r = 4, alpha = 8, targets = "all-linear", '
                                   'b_init = "normal" }', 'adapter = { strategy = "none" }'))
    done = weft("plan", "q.toml", cwd=tmp_path)
    message = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr[-2000:]
    assert "quantize = 'nf4' stores weights no optimizer can update" in message and "q.toml:" in message


def _write_fsdp2_4bit(tmp_path, *, tile):
    tiles = f", mlp_tile_tokens = {tile}" if tile else ""
    _write(tmp_path, QLORA.replace('shard = { strategy = "none", quantize = "nf4", checkpoint = "full" }',
                                   f'shard = {{ strategy = "fsdp2", quantize = "nf4", checkpoint = "full"{tiles} }}')
           .replace('name = "everything else whole"\nshard = { strategy = "none" }',
                    'name = "everything else: the root"\nshard = { strategy = "fsdp2" }'))


@pytest.mark.parametrize("tile", [0, 8])
def test_check_is_exact_with_4bit_units_sharded_by_fsdp2(weft, tmp_path, tile):
    """FSDP2 over 4-bit units: each rank holds its rows of torchao's NF4 codes (quantised before
    fully_shard), the all-gather rebuilds them; the plan's loss and adapter gradients equal the
    unsharded reference's with the same codes. With the MLP in tiles of 8 tokens too (its 4-bit
    weights expanded once a pass while FSDP2 holds them gathered, the recomputation stopping
    before the tiles; a 1% error in the tiles' input gradient fails it)."""
    _write_fsdp2_4bit(tmp_path, tile=tile)
    done = weft("check", "q.toml", "--world-size", "2", "--set", "parallel.dp_shard=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4
    assert result["grad_params"] == {"reference": 28, "plan": 28}  # the adapters only


def test_a_shard_degree_that_does_not_divide_4bit_rows_is_the_rules_error(weft, tmp_path):
    """Not torchao's assertion: the rule, its file and line, the rows and scaler groups."""
    _write_fsdp2_4bit(tmp_path, tile=0)
    done = weft("check", "q.toml", "--world-size", "3", "--set", "parallel.dp_shard=3", cwd=tmp_path)
    message = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr[-2000:]
    assert ("shard rule '4-bit text layers' (q.toml:" in message and "under FSDP2 over 3 ranks" in message
            and "64 rows and 8 scaler groups, not both multiples of 3" in message)


def test_a_4bit_run_checkpoints_its_adapters_alone_resumes_and_exports_what_it_trained(weft, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp

    _write(tmp_path, QLORA.replace("checkpoint_every = 0", "checkpoint_every = 2\nkeep_checkpoints = 5")
           .replace("max_steps = 6", "max_steps = 4"))
    done = weft("run", "q.toml", "--nproc", "1", "--run-dir", "a", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    assert losses[4] < losses[1]
    saved = dcp.FileSystemReader(str(tmp_path / "a" / "checkpoints" / "step-4")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert len(weights) == 28 and all(".lora_" in k for k in weights)  # no base weight, 4-bit or not
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-4")
    done = weft("run", "q.toml", "--nproc", "1", "--run-dir", "b", "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert {row["step"]: row["loss"] for row in rows if "loss" in row and row["step"] > 2} == {
        3: losses[3], 4: losses[4]}
    # Export: the adapters merged into the dequantised 4-bit weights: transformers' model
    # computes what the trained (4-bit + adapters) model computes.
    assert weft("export", "a", "hf", "--merge", cwd=tmp_path).returncode == 0
    import torch.distributed as dist
    from transformers import Qwen2_5_VLForConditionalGeneration

    from weft.core.checkpoint.read import load_checkpoint_into
    from weft.core.plan.planner import add_adapters

    recipe = _write(tmp_path)
    plan, pm = _plan(recipe)
    trained = pm.models.for_recipe(recipe).build(recipe, device="cpu", seed=recipe.train.seed,
                                                 quantize=plan.quantized_units())
    add_adapters(trained, plan=plan, pm=pm, ctx=None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        load_checkpoint_into(trained, tmp_path / "a" / "checkpoints" / "step-4")
    finally:
        dist.destroy_process_group()
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expanded_is_torchaos_dequantisation_bit_for_bit(dtype):
    """weft's one-kernel expansion of an NF4 weight (the tiled MLP's) against torchao's own, at
    QLoRA's scaler blocks and at a tiny weight's smaller ones."""
    from weft.strategies.model.quantize import expanded, to_nf4

    for shape in ((512, 256), (8, 64)):
        weight = torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(3)) * 2
        quantized = to_nf4(weight)
        assert torch.equal(expanded(quantized), quantized.get_original_weight())
        assert expanded(quantized).dtype == dtype


def test_the_compiled_expansion_a_gpu_runs_is_torchaos_too():
    """The Inductor kernel ``expanded`` takes on a GPU, compiled here for the CPU: the same values
    bit for bit (its float32 arithmetic rounds a bf16 x bf16 product as the eager one does)."""
    from weft.strategies.model.quantize import _compiled_expand, to_nf4

    quantized = to_nf4(torch.randn(256, 512, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4)))
    scalers = quantized.dequantize_scalers(quantized.quantized_scalers, quantized.quantization_factor,
                                           quantized.scaler_block_size)
    got = _compiled_expand()(quantized.quantized_data, quantized.nf4, scalers).view(quantized.shape)
    assert torch.equal(got, quantized.get_original_weight())
