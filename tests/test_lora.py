"""LoRA by rule (`adapter = { strategy = "lora", ... }`): PEFT's layers on the matched modules,
the base frozen. Only the adapters get gradients and optimizer state; step 0's loss is the
base model's (B starts at zero); a run trains them (the loss falls) and leaves the base's
weights as they were; `weft check` is exact with the reference given the same adapters."""

from __future__ import annotations

import json

import pytest
import torch

LORA = ('[model]\npreset = "qwen2_5_vl_tiny"\n[data]\nnum_samples = 64\n[train]\nmicro_batch_tokens = 1024\n'
        'checkpoint_every = 0\nmax_steps = 6\nlr = 1e-2\nwarmup_steps = 0\nprecision = "fp32"\n[[rules]]\n'
        'name = "lora on the text decoder"\nwhen = { modality = "text" }\n'
        'adapter = { strategy = "lora", r = 4, alpha = 8, dropout = 0.0, targets = ["q_proj", "v_proj"] }\n')


def _tiny(tmp_path, text: str = LORA, *, name: str = "lora.toml"):
    from weft.core.recipe import Recipe

    (tmp_path / name).write_text(text)
    return Recipe.from_toml(str(tmp_path / name))


def _adapted(recipe, *, seed: int = 0):
    """The unsharded model with the plan's adapters, as `weft check`'s reference builds it."""
    from weft.core.plan.planner import add_adapters, plan_recipe
    from weft.core.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(entry_points=False)
    plan, _ = plan_recipe(recipe, pm=pm, world_size=1)
    model = pm.models.for_recipe(recipe).build(recipe, device="cpu", seed=seed)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    [added] = add_adapters(model, plan=plan, pm=pm, ctx=None)
    added.init(model, seed=seed)
    return model, base, added


def _trained(recipe, run_dir):
    """The adapted model (``_adapted``) with a run's last checkpoint loaded (in a one-process
    group, as the checkpoint reader wants one)."""
    import torch.distributed as dist

    from weft.core.checkpoint.read import checkpoint_dirs, load_checkpoint_into

    model, base, added = _adapted(recipe)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        load_checkpoint_into(model, checkpoint_dirs(run_dir)[-1])
    finally:
        dist.destroy_process_group()
    return model, base, added


def test_only_the_adapters_train_and_step_0_is_the_base(tmp_path):
    from model_helpers import build_model, optimizer_for

    recipe = _tiny(tmp_path)
    model, base, added = _adapted(recipe)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == list(added.names) and len(trainable) == 8  # q and v of 2 layers, A and B each
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # The base's weights keep their values under PEFT's base_layer.
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()}
    assert all(torch.equal(state[k], v) for k, v in base.items())
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    reference = build_model(recipe)  # the base alone, same seed
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)  # B = 0
    model(input_ids=ids, labels=ids).loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(trainable)
    optimizer, _ = optimizer_for(recipe, model)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if n in trainable}


def test_a_run_trains_the_adapters_and_leaves_the_base(weft, tmp_path):
    recipe = _tiny(tmp_path, LORA.replace("checkpoint_every = 0", "checkpoint_every = 6"))
    done = weft("run", "lora.toml", "--nproc", "1", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 6 and losses[-1] < losses[0]
    # Gradients and AdamW's two moments for the adapters only.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["state_gib"]
    model, base, added = _trained(recipe, tmp_path / "run")
    adapters = sum(p.numel() for n, p in model.named_parameters() if n in added.names)
    assert summary["trainable_params"] == adapters
    assert summary["gradients"] * 2**30 == adapters * 4
    assert abs(summary["optimizer"] * 2**30 - 2 * adapters * 4) < 4096
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()}
    assert all(torch.equal(state[k], v) for k, v in base.items())  # the base as it was drawn
    lora_b = [v for k, v in state.items() if ".lora_B." in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)  # the adapters moved
    # `weft export` folds the adapters into the base's weights: a plain transformers model with
    # the adapted model's logits.
    assert weft("export", "run", "hf", "--merge", cwd=tmp_path).returncode == 0
    from transformers import Qwen2_5_VLForConditionalGeneration

    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf")
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    assert json.loads((tmp_path / "hf" / "weft_export.json").read_text())["adapters"] == "merged"
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_check_is_exact_with_lora_under_ring2(weft, tmp_path):
    _tiny(tmp_path)
    done = weft("check", "lora.toml", "--world-size", "2", "--set", "parallel.ring=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4
    assert result["grad_params"] == {"reference": 8, "plan": 8}  # the adapters, on both sides
    assert ".lora_" in result["grad_max_rel_diff_param"]


def test_plan_says_what_trains_and_names_a_rule_that_adapts_nothing(weft, tmp_path):
    _tiny(tmp_path)
    done = weft("plan", "lora.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("trains 1,792 of 200,672 parameters; adapters by rule, the base frozen: lora on the text decoder"
            in " ".join(done.stdout.split()))
    # A rule whose when matches no module, and one whose targets name no layer: exit 2, the rule named.
    _tiny(tmp_path, LORA.replace('when = { modality = "text" }', 'when = { path = "*.nowhere" }'))
    done = weft("plan", "lora.toml", cwd=tmp_path)
    assert done.returncode == 2
    assert "adapter rule 'lora on the text decoder' decides no module" in done.stderr
    assert "lora.toml:12" in done.stderr
    _tiny(tmp_path, LORA.replace('["q_proj", "v_proj"]', '["qkv_proj"]'))
    done = weft("plan", "lora.toml", cwd=tmp_path)
    assert done.returncode == 2
    message = " ".join(done.stderr.split())
    assert "adapter rule 'lora on the text decoder': targets ['qkv_proj'] name no linear layer" in message
    assert "lora.toml:12 (adapter.targets)" in message and "'q_proj'" in message


def test_check_is_exact_for_the_gradients_of_a_too(weft, tmp_path):
    """With B = 0, A's gradients are zero at step 0 on both sides; b_init = "normal" makes the
    one step `weft check` compares reach A as well (dp 2: the adapters' reduce-scatter)."""
    _tiny(tmp_path, LORA.replace('targets = ["q_proj", "v_proj"]', 'targets = "all-linear", b_init = "normal"'))
    done = weft("check", "lora.toml", "--world-size", "2", "--set", "parallel.dp_shard=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4
    assert result["micro_batches"] == 2
    assert result["grad_params"]["plan"] == result["grad_params"]["reference"] > 8


@pytest.fixture
def model_dir(tmp_path):
    """The tiny preset saved as a model directory, with the tiny processor's files."""
    import pathlib
    import shutil

    from model_helpers import build_model
    from weft.core.recipe import Recipe

    folder = tmp_path / "tiny-model"
    build_model(Recipe.from_dict({"model": {"preset": "qwen2_5_vl_tiny"}}), seed=3).save_pretrained(folder)
    for file in (pathlib.Path(__file__).resolve().parents[1] / "recipes" / "tiny_vl").iterdir():
        if file.is_file():
            shutil.copy(file, folder / file.name)
    return folder


def test_lora_on_a_model_directory_loads_the_base_through_peft_layers(weft, model_dir, tmp_path):
    """A base read from model.path: each rank loads its shards into PEFT's base_layer (the
    checkpoint's names), the adapters are not in the checkpoint and are drawn after it."""
    text = LORA.replace('preset = "qwen2_5_vl_tiny"', f'path = "{model_dir}"').replace("num_samples = 64",
                                                                                     "num_samples = 8")
    _tiny(tmp_path, text.replace('targets = ["q_proj", "v_proj"]', 'targets = "all-linear", b_init = "normal"'))
    done = weft("check", "lora.toml", "--world-size", "2", "--set", "parallel.ring=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["grad_params"]["plan"] == result["grad_params"]["reference"] == 28


def test_an_adapter_run_resumes_as_it_would_have_gone_on(weft, tmp_path):
    """Resumed from its step-2 checkpoint (the newer one removed), an adapter run's steps 3-4
    and its adapters equal the unbroken run's: the checkpoint holds the adapters and their
    AdamW states (the frozen base has none)."""
    import shutil

    _tiny(tmp_path, LORA.replace("checkpoint_every = 0", "checkpoint_every = 2\nkeep_checkpoints = 5")
          .replace("max_steps = 6", "max_steps = 4"))
    done = weft("run", "lora.toml", "--nproc", "1", "--run-dir", "a", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-4")
    done = weft("run", "lora.toml", "--nproc", "1", "--run-dir", "b", "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    def losses(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {row["step"]: row["loss"] for row in rows if "loss" in row}

    assert json.loads((tmp_path / "b" / "summary.json").read_text())["start_step"] == 2
    assert losses("b")[3] == losses("a")[3] and losses("b")[4] == losses("a")[4]
    for run in ("a", "b"):
        assert weft("export", run, f"{run}-hf", "--merge", cwd=tmp_path).returncode == 0
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a-hf" / "model.safetensors"), load_file(tmp_path / "b-hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mesh", [("parallel.ulysses=2", "parallel.ring=2"),
                                  ("parallel.dp_shard=2", "parallel.ring=2")], ids=["ulysses2xring2", "dp2xring2"])
def test_check_is_exact_with_lora_on_four_ranks(weft, tmp_path, mesh):
    """Issue 27's equalities: LoRA on every linear layer of both towers (B drawn, so A's
    gradients count too), the text layers fully checkpointed, under USP and dp x ring."""
    text = LORA.replace('targets = ["q_proj", "v_proj"]', 'targets = "all-linear", b_init = "normal"')
    text += ('[[rules]]\nname = "checkpointed text layers"\nwhen = { path = "*.language_model.layers.*" }\n'
             'shard = { strategy = "fsdp2", checkpoint = "full" }\n[[rules]]\nname = "lora on the tower"\n'
             'when = { path = "*.visual.blocks.*" }\n'
             'adapter = { strategy = "lora", r = 2, alpha = 4, targets = "all-linear", b_init = "normal" }\n')
    _tiny(tmp_path, text)
    done = weft("check", "lora.toml", "--world-size", "4", *(arg for m in mesh for arg in ("--set", m)), "--json",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4
    assert result["grad_params"]["plan"] == result["grad_params"]["reference"] > 28  # both towers' adapters


def test_export_writes_a_peft_adapter_directory_that_peft_and_weft_eval_load(weft, tmp_path):
    """`weft export` of a LoRA run: PEFT's adapter directory (no base weights in it);
    `PeftModel.from_pretrained` over the base gives the trained model's logits, and
    `weft eval --adapter DIR` the loss `weft eval --run-dir` gives."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from model_helpers import build_model

    recipe = _tiny(tmp_path, LORA.replace("checkpoint_every = 0", "checkpoint_every = 6"))
    assert weft("run", "lora.toml", "--nproc", "1", "--run-dir", "run", cwd=tmp_path).returncode == 0
    done = weft("export", "run", "ad", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    tensors = load_file(tmp_path / "ad" / "adapter_model.safetensors")
    assert len(tensors) == 8 and all(k.startswith("base_model.model.") and ".lora_" in k for k in tensors)
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == "qwen2_5_vl_tiny"
    assert json.loads((tmp_path / "ad" / "weft_export.json").read_text())["adapters"] == "adapter directory"

    trained, _, _ = _trained(recipe, tmp_path / "run")
    peft_model = PeftModel.from_pretrained(build_model(recipe), tmp_path / "ad")
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, trained(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    losses = {}
    for flag, value in (("--run-dir", "run"), ("--adapter", "ad")):
        done = weft("eval", "lora.toml", flag, value, "--max-batches", "2", "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        losses[flag] = json.loads(done.stdout)["loss"]
    assert abs(losses["--adapter"] - losses["--run-dir"]) <= 1e-6 * abs(losses["--run-dir"])
    done = weft("eval", "lora.toml", "--adapter", "run", cwd=tmp_path)  # not an adapter directory: a message
    assert done.returncode == 2 and "has no adapter_config.json" in done.stderr
