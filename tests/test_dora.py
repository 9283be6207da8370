"""DoRA by rule (`adapter = { strategy = "lora", dora = true }`): PEFT's DoRA layers, their
magnitudes drawn after the base's weights (strategies/model/dora.py) so the model starts as
the base; `weft check` is exact with them sharded by FSDP2 and under ring 2; a run's export is
PEFT's adapter directory, magnitudes included, which `PeftModel.from_pretrained` loads to the
trained model's logits, and `--merge` folds them into plain weights with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from test_lora import LORA, _adapted, _tiny, _trained

DORA = LORA.replace('targets = ["q_proj", "v_proj"] }', 'targets = ["q_proj", "v_proj"], dora = true }')


def test_the_magnitudes_are_the_rows_norms_and_step_0_is_the_base(tmp_path):
    from model_helpers import build_model

    recipe = _tiny(tmp_path, DORA)
    model, _, added = _adapted(recipe)
    magnitudes = [n for n in added.names if ".lora_magnitude_vector." in n]
    assert len(magnitudes) == 4 and len(added.names) == 12  # q and v of 2 layers: A, B, magnitudes
    layer = model.get_submodule("model.language_model.layers.0.self_attn.q_proj")
    torch.testing.assert_close(layer.lora_magnitude_vector["default"].weight, layer.base_layer.weight.norm(dim=1))
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, build_model(recipe)(input_ids=ids).logits,
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mesh", ["parallel.dp_shard=2", "parallel.ring=2"], ids=["fsdp2", "ring2"])
def test_check_is_exact_with_dora(weft, tmp_path, mesh):
    """b_init = "normal": B is not zero, so the magnitudes (W + B @ A's row norms, each rank its
    rows under FSDP2) and A, B and the magnitudes' gradients all differ from LoRA's."""
    _tiny(tmp_path, DORA.replace('targets = ["q_proj", "v_proj"]', 'targets = "all-linear", b_init = "normal"'))
    done = weft("check", "lora.toml", "--world-size", "2", "--set", mesh, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4


def test_export_loads_in_peft_and_merges_to_the_trained_logits(weft, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from model_helpers import build_model

    recipe = _tiny(tmp_path, DORA.replace("checkpoint_every = 0", "checkpoint_every = 6"))
    done = weft("run", "lora.toml", "--nproc", "1", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert weft("export", "run", "ad", cwd=tmp_path).returncode == 0
    assert weft("export", "run", "hf", "--merge", cwd=tmp_path).returncode == 0
    tensors = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    assert sum(k.endswith(".lora_magnitude_vector") for k in tensors) == 4 and len(tensors) == 12
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["use_dora"] is True
    trained, _, _ = _trained(recipe, tmp_path / "run")
    layer = trained.get_submodule("model.language_model.layers.0.self_attn.q_proj")
    moved = layer.lora_magnitude_vector["default"].weight - layer.base_layer.weight.norm(dim=1)
    assert moved.abs().max() > 0  # the magnitudes trained
    peft_model = PeftModel.from_pretrained(build_model(recipe), tmp_path / "ad")
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_dora_over_a_4bit_base_is_the_rules_error(weft, tmp_path):
    """PEFT's DoRA cannot read torchao's NF4 weights (its forward fails): a plan error naming
    the rule, not a traceback at step 1."""
    from test_qlora import QLORA

    (tmp_path / "q.toml").write_text(QLORA.replace('b_init = "normal" }', 'b_init = "normal", dora = true }'))
    done = weft("plan", "q.toml", cwd=tmp_path)
    message = " ".join(done.stderr.split())
    assert done.returncode == 2 and "dora = true over a 4-bit base" in message and "q.toml:" in message, message
