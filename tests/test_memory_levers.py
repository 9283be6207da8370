"""Memory levers chosen by rule: storage dtype of weights and optimizer states, FSDP2 offload
with global-norm clipping, and runs that write no checkpoint."""

from __future__ import annotations

import json
import pathlib
import textwrap

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
RULES = ROOT / "recipes" / "rules" / "modality-groups.toml"


def test_bf16_storage_by_rule_trains_and_checkpoints_in_bf16(weft, tmp_path):
    """storage_dtype = "bfloat16" for the language model, float32 kept for the vision tower:
    weights, gradients and AdamW states of each unit in its dtype; the checkpoint (and the
    export) in the weights' own dtype."""
    recipe = tmp_path / "bf16.toml"
    recipe.write_text(textwrap.dedent(f'''
        include = ["{RULES}"]
        [model]
        preset = "qwen2_5_vl_tiny"
        [train]
        max_steps = 3
        [parallel]
        nproc = 1
        [[rules]]
        when = {{ modality = ["text", "embedding", "head"] }}
        shard = {{ strategy = "fsdp2", group = "language", storage_dtype = "bfloat16" }}
        [[rules]]
        name = "root: whatever no unit owns"
        when = {{ path = "" }}
        shard = {{ strategy = "fsdp2", storage_dtype = "bfloat16" }}
    '''))
    done = weft("run", str(recipe), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rows)
    done = weft("export", str(tmp_path / "run"), str(tmp_path / "export"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["lm_head.weight"] == "BF16" and dtypes["model.layers.0.mlp.up_proj.weight"] == "BF16"
    assert dtypes["visual.blocks.0.mlp.up_proj.weight"] == "F32"  # the vision rule keeps float32


import pytest  # noqa: E402


@pytest.mark.quick
@pytest.mark.parametrize("strategy", ["fsdp2", "none"])
def test_storage_dtype_reaches_the_optimizer_states(strategy):
    """In-process, one rank: the units' parameters are bf16 (DTensors under fsdp2, plain tensors
    unsharded) and AdamW keeps bf16 states."""
    import structlog
    import torch.distributed as dist

    from weft.core.context import RunContext
    from weft.core.plugin_manager import build_plugin_manager
    from weft.core.recipe import Recipe
    from weft.core.train.optimizer_setup import make_optimizer
    from weft.core.train.prepare import prepare_model

    recipe = Recipe.from_dict({
        "model": {"preset": "qwen2_text_tiny"},
        "rules": [{"shard": {"strategy": strategy, "storage_dtype": "bfloat16"}}],
    })
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = RunContext(recipe=recipe, device=torch.device("cpu"), log=structlog.get_logger())
        pm = build_plugin_manager(entry_points=False)
        run = prepare_model(recipe=recipe, pm=pm, ctx=ctx)
        assert {p.dtype for p in run.model.parameters()} == {torch.bfloat16}
        sharded = {type(p).__name__ == "DTensor" for p in run.model.parameters()}
        assert sharded == {strategy == "fsdp2"}
        optimizer, _ = make_optimizer(recipe, run.model, plan=run.plan, pm=pm, ctx=ctx)
        ids = torch.randint(0, 300, (1, 16))
        run.model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        states = [t for state in optimizer.state.values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq")]
        assert states and {t.dtype for t in states} == {torch.bfloat16}
        # Rotary tables are buffers: left in float32.
        assert all(b.dtype == torch.float32 for n, b in run.model.named_buffers() if n.endswith("inv_freq"))
    finally:
        dist.destroy_process_group()


def test_an_unsharded_unit_in_another_dtype_than_its_fsdp2_root_is_a_plan_error(weft, tmp_path):
    """FSDP2 gathers an unsharded unit's weights with its root's, in one dtype: a bf16 'none' unit
    under a float32 FSDP2 root is named at plan time (exit 2), not an assertion at the first step."""
    recipe = tmp_path / "mixed.toml"
    recipe.write_text(textwrap.dedent('''
        [model]
        preset = "qwen2_text_tiny"
        [parallel]
        nproc = 1
        [[rules]]
        when = { path = "model.layers.0" }
        shard = { strategy = "none", storage_dtype = "bfloat16" }
        [[rules]]
        shard = { strategy = "fsdp2" }
    '''))
    done = weft("run", str(recipe), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "model.layers.0" in done.stderr and "storage_dtype" in done.stderr and "Traceback" not in done.stderr


def test_offload_with_clipping_equals_the_unsharded_model(weft, tmp_path):
    """FSDP2 offload (shards and optimizer state on the CPU) with global-norm clipping: weft check
    on 2 ranks equals the unsharded model before and after clipping, norm included."""
    recipe = tmp_path / "offload.toml"
    recipe.write_text(textwrap.dedent(f'''
        include = ["{RULES}"]
        [model]
        preset = "qwen2_5_vl_tiny"
        [[rules]]
        shard = {{ strategy = "fsdp2", offload = true }}
    '''))
    done = weft("check", str(recipe), "--world-size", "2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["grad_norm_rel_diff"] <= 1e-5 and result["clipped_grad_max_rel_diff"] <= 1e-4, result


def test_checkpoint_every_minus_one_writes_none(weft, tmp_path):
    done = weft("run", "tiny-vl", "--nproc", "1", "--set", "train.max_steps=2", "--set", "train.checkpoint_every=-1",
                "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_fused_loss_under_fsdp_and_sp_equals_the_unsharded_model(weft, tmp_path):
    """train.loss = "fused": the logits never exist (lm_head and the loss by chunks from the hidden
    states, the head's weights in the root FSDP unit); a ring of 2 over FSDP equals the
    unsharded model computing full logits, loss and every gradient."""
    done = weft("check", "tiny-vl", "--world-size", "2", "--set", "train.loss=fused",
                "--set", "parallel.ring=2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and {"head", "text", "vision"} <= set(result["grad_max_rel_diff_by_group"]), result


def test_tied_embeddings_stay_tied_sharded_and_fused(weft, tmp_path):
    """tie_word_embeddings (as Qwen2.5-VL-3B): built on meta and materialised per shard, the head
    and the embedding keep one weight (one FSDP unit); with the fused loss too, exact."""
    tiny = (ROOT / "recipes" / "presets" / "qwen2_5_vl_tiny.toml").read_text()
    preset = tmp_path / "tied_tiny.toml"
    preset.write_text(tiny.replace("tie_word_embeddings = false", "tie_word_embeddings = true"))
    done = weft("check", "tiny-vl", "--world-size", "2", "--set", f"model.preset={preset}",
                "--set", "train.loss=fused", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and "embedding" in result["grad_max_rel_diff_by_group"], result
