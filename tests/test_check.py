"""`weft check`: the unsharded model vs the recipe's plan on 4 gloo ranks (FSDP2 + SP)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from weft_cli import Done, run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny-vl.toml")
TINY_SP = str(ROOT / "recipes" / "tiny-vl-sp.toml")


def check(*args: str, env: dict | None = None, cwd: pathlib.Path) -> Done:
    """`weft check` in this process, its ranks forked from the warm forkserver (tests/forked_ranks.py)."""
    return run_weft("check", *args, env=env, cwd=cwd)


def check_process(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """`python -m weft check`: its ranks from torch's elastic agent, as a user's are."""
    return subprocess.run([sys.executable, "-m", "weft", "check", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def test_dp2_x_ulysses2_and_other_model_families(tmp_path):
    """dp 2 x sp 2 (FSDP2 over dp_shard x ulysses) on the VL model, whose first batch has images
    of 24 patches: the bundled recipe's vision-Ulysses rule makes the SP ranks share the tower;
    then Qwen2-VL (no window attention in its ViT) and text-only Qwen2 under ulysses 2."""
    for world, extra in ((4, []), (2, ["--set", "model.preset=qwen2_vl_tiny"]),
                         (2, ["--set", "model.preset=qwen2_text_tiny"])):
        done = check(TINY_SP, "--world-size", str(world), *extra, "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
        assert result["mesh"] == {"dp_replicate": 1, "dp_shard": world // 2, "ring": 1, "ulysses": 2}
        assert result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result
        groups = set(result["grad_max_rel_diff_by_group"])
        assert {"text", "embedding", "head"} <= groups
        if "model.preset=qwen2_text_tiny" not in extra:
            assert {"vision", "projector"} <= groups
        assert {"loss_ref", "loss", "loss_rel_diff", "grad_max_rel_diff"} <= result.keys()


def test_check_table_output(tmp_path):
    # The one `weft check` through the real launcher: its ranks are `python -m weft _check-worker`.
    done = check_process(TINY, "--world-size", "2", "--set", "parallel.ring=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss relative difference" in done.stdout and "gradient norm relative difference" in done.stdout
    assert "OK" in done.stdout


BROKEN_PLUGIN = '''
"""A wrong attention plugin: claims to span the ring but attends only to its own part."""
import torch.nn.functional as F
from weft.core.hookspecs import hookimpl
from weft.core.registry import AttentionBinding, NoParams, Strategy


def local_only(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@hookimpl
def weft_strategies():
    return [Strategy(point="attention", name="broken_ring", params=NoParams, sp_dims=("ring",))]


@hookimpl
def weft_attention(decision, module_path, plan, mesh, ctx):
    if decision.strategy == "broken_ring":
        return AttentionBinding(name="weft_test_broken_ring", fn=local_only)
    return None
'''


def _site_plugin(tmp_path, name: str, source: str) -> dict:
    site = tmp_path / "site"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(textwrap.dedent(source))
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[weft]\n{name} = {name}\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


def _broken(tmp_path, *, precision: str = "fp32") -> tuple[dict, pathlib.Path]:
    """The wrong attention plugin installed, and a ring-2 recipe whose text attention uses it."""
    env = _site_plugin(tmp_path, "broken_ring_plugin", BROKEN_PLUGIN)
    recipe = tmp_path / "broken.toml"
    recipe.write_text(textwrap.dedent(f'''
        include = ["{ROOT / "recipes" / "rules" / "modality-groups.toml"}"]
        [model]
        preset = "qwen2_5_vl_tiny"
        [train]
        precision = "{precision}"
        [parallel]
        ring = 2
        [[rules]]
        when = {{ modality = "text" }}
        attention = {{ strategy = "broken_ring" }}
    '''))
    return env, recipe


def test_check_catches_a_wrong_plugin(tmp_path):
    env, recipe = _broken(tmp_path)
    done = check(str(recipe), "--world-size", "2", "--json", env=env, cwd=tmp_path)
    # Exit code 1 is also what a crashed run gives: the JSON report tells the two apart.
    assert done.returncode == 1 and done.stdout.lstrip().startswith("{"), done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert not result["ok"] and result["loss_rel_diff"] > 1e-3


def test_data_parallel_rank_without_images_keeps_the_tower_in_step(tmp_path):
    """DP rank 0's samples are text-only, rank 1's have images: FSDP's vision collectives
    still line up (rank 0 runs a blank image with weight zero) and nothing changes numerically."""
    from PIL import Image

    Image.new("RGB", (56, 84), "red").save(tmp_path / "red.png")
    text = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there."}]}
    image = {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
             "images": ["red.png"]}
    # Two samples too long to share a micro-batch of 80 tokens (60 and 63, the chat template's
    # default system prompt included): one per data-parallel rank.
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(r) for r in (text, image)) + "\n")
    recipe = tmp_path / "mixed.toml"
    recipe.write_text(textwrap.dedent(f'''
        include = ["{ROOT / "recipes" / "rules" / "modality-groups.toml"}"]
        [model]
        preset = "qwen2_5_vl_tiny"
        [data]
        source = "jsonl"
        path = "mixed.jsonl"
        [train]
        micro_batch_tokens = 80
    '''))
    done = check(str(recipe), "--world-size", "2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and "vision" in result["grad_max_rel_diff_by_group"], result
    assert result["micro_batches"] == 2, result


GRAD_DOUBLER = '''
"""A buggy plugin: the loss's backward scaled x2 (every gradient doubled, uniformly)."""
from weft.core.hookspecs import hookimpl


def _double(module, args, output):
    output.register_hook(lambda grad: 2 * grad)


@hookimpl
def weft_shard(model, ctx):
    model.get_output_embeddings().register_forward_hook(_double)
'''


def test_check_catches_a_gradient_scale_error(tmp_path):
    """A uniform x2 in the backward survives clipping (both sides clip to max_norm 1.0), so
    weft check compares the gradients before grad sync and the global gradient norm."""
    env = _site_plugin(tmp_path, "grad_doubler", GRAD_DOUBLER)
    done = check(TINY, "--world-size", "2", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout.lstrip().startswith("{"), done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert not result["ok"] and result["loss_rel_diff"] <= 1e-5, result  # the loss itself is right
    assert abs(result["grad_max_rel_diff"] - 1.0) < 1e-3, result  # every gradient twice the truth
    assert abs(result["grad_norm"] / result["grad_norm_ref"] - 2.0) < 1e-3, result
    # After clipping both sides have norm 1.0: that comparison alone would pass.
    assert result["clipped_grad_max_rel_diff"] <= 1e-4, result


def test_third_party_batching_under_ulysses2_x_ring2(tmp_path):
    """A batching strategy that knows nothing of sequence parallelism (tests/weft_test_plugins.py,
    whole-sequence micro-batches, two per rank) trains under ulysses 2 x ring 2 on 4 ranks and is
    exact: the core pads, shifts and cuts its micro-batches, and weft check takes them from it."""
    from plugin_site import plugin_env

    env = plugin_env(tmp_path, module="weft_test_plugins", entry="weft-test")
    recipe = tmp_path / "third_party.toml"
    recipe.write_text(textwrap.dedent(f'''
        include = ["{ROOT / "recipes" / "rules" / "modality-groups.toml"}"]
        [model]
        preset = "qwen2_5_vl_tiny"
        [train]
        max_steps = 2
        warmup_steps = 1
        [parallel]
        nproc = 4
        ulysses = 2
        ring = 2
        [[rules]]
        batching = {{ strategy = "fixed_global", samples_per_step = 4, parts = 2 }}
    '''))
    done = check(str(recipe), "--world-size", "4", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "ring": 2, "ulysses": 2}
    assert result["micro_batches"] == 2  # both of the strategy's micro-batches, accumulated
    assert result["loss_rel_diff"] <= 1e-5 and result["grad_max_rel_diff"] <= 1e-4, result
    assert {"vision", "projector", "text"} <= set(result["grad_max_rel_diff_by_group"])
    run = run_weft("run", str(recipe), "--run-dir", str(tmp_path / "run"), env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)


def test_bf16_check_measures_against_the_unsharded_models_own_bf16_error(tmp_path):
    """train.precision = "bf16": the plan (ring 2, bf16 autocast) against the float32 reference,
    allowed twice the unsharded model's own bf16 difference from it (its floor, reported);
    the wrong plugin's difference is far beyond that floor."""
    done = check(TINY, "--world-size", "2", "--set", "parallel.ring=2", "--set", "train.precision=bf16", "--json",
                 cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    floor = result["bf16_floor"]
    assert result["ok"] and result["precision"] == "bf16" and floor["grad_max_rel_diff"] > 1e-4  # bf16 is not exact
    assert result["grad_max_rel_diff"] <= 2 * floor["grad_max_rel_diff"], result
    assert result["tolerances"]["grad"] == max(1e-4, 2 * floor["grad_max_rel_diff"])
    env, recipe = _broken(tmp_path, precision="bf16")
    done = check(str(recipe), "--world-size", "2", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout.lstrip().startswith("{"), done.stderr[-3000:]
    broken = json.loads(done.stdout)
    assert not broken["ok"] and broken["loss_rel_diff"] > 2 * broken["bf16_floor"]["loss_rel_diff"]
