"""FSDP2 training equals one process; checkpoints resume exactly, across a crash and a world-size change; export.

Every run goes through `weft run` (the real loop, FSDP2, DCP checkpoints) with the test
batching strategy ``fixed_global`` (tests/weft_test_plugins.py): the same global batch per
step whatever the number of data-parallel ranks. The ranks are forked from the tests'
forkserver (tests/forked_ranks.py), but for the restart, which is torch's elastic agent's.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from plugin_site import plugin_env
from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return plugin_env(tmp_path_factory.mktemp("plugins"), module="weft_test_plugins", entry="weft-test")


RECIPE = '''
        include = ["{rules}"]
        [model]
        preset = "qwen2_5_vl_tiny"
        [train]
        max_steps = 4
        lr = 3e-3
        warmup_steps = 1
        checkpoint_every = 2
        keep_checkpoints = 5
        [[rules]]
        batching = {{ strategy = "fixed_global", samples_per_step = 4, parts = 2 }}
        guard = [{{ strategy = "finite" }}{kill}]
'''


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> dict[str, pathlib.Path]:
    """"clean", and "kill": SIGKILL of rank 1 at the start of step 4 (fresh runs only)."""
    folder = tmp_path_factory.mktemp("recipe")
    rules = ROOT / "recipes" / "rules" / "modality-groups.toml"
    out = {}
    for name, kill in (("clean", ""), ("kill", ', {{ strategy = "kill", step = 4, rank = 1 }}')):
        out[name] = folder / f"{name}.toml"
        out[name].write_text(
            textwrap.dedent(RECIPE.format(rules=rules, kill=kill.replace("{{", "{").replace("}}", "}"))))
    return out


def weft_process(*args: str, env: dict, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """A real launcher: torch's elastic agent restarts the ranks after one dies (--max-restarts)."""
    return subprocess.run([sys.executable, "-m", "weft", *args], capture_output=True, text=True, timeout=600, env=env,
                          cwd=cwd)


def train(recipe, run_dir, env, *extra):
    """`weft run` in this process (its ranks forked); with --max-restarts, a real launcher."""
    done = (weft_process if "--max-restarts" in extra else run_weft)("run", str(recipe), "--run-dir", str(run_dir),
                                                                     *extra, env=env, cwd=run_dir.parent)
    return done


def exported(run_dir: pathlib.Path, env: dict, *, step: int | None = None) -> dict:
    out = run_dir.parent / f"{run_dir.name}-export{step or ''}"
    # The module exports the same run more than once: each replaces the one before whole.
    done = run_weft("export", str(run_dir), str(out), *(["--step", str(step)] if step else []), "--overwrite",
                    env=env, cwd=run_dir.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


#: Attention key biases: softmax is invariant to a constant added to every key, so their
#: true gradient is zero and AdamW moves them on rounding noise (normalised by a
#: noise-sized second moment). Their values differ at noise level between any two
#: orders of summation; they are compared on the model's scale instead of their own.
NOISE_ONLY = ("k_proj.bias",)
FUSED_QKV_BIAS = "qkv.bias"  # the vision tower's fused bias: its middle third is the key bias


def assert_same_params(got: dict, want: dict, *, rel: float) -> None:
    """Per tensor, relative error in the L2 norm: ||got - want|| / ||want|| <= rel.

    The norm, not the largest element: AdamW divides each element's update by its own
    gradient's running magnitude, so an element whose gradient is tiny turns summation-
    order rounding into a visible difference while the tensor as a whole agrees.
    """
    assert got.keys() == want.keys()
    scale = max(w.norm().item() for w in want.values())
    pairs = []
    for name, w in want.items():
        if name.endswith(FUSED_QKV_BIAS):
            for part, g, x in zip(("q", "k", "v"), got[name].chunk(3), w.chunk(3)):
                pairs.append((f"{name}[{part}]" if part != "k" else f"{name}[k_proj.bias]", g, x))
        else:
            pairs.append((name, got[name], w))
    for name, g, w in pairs:
        diff = (g - w).norm().item()
        if name.rstrip("]").endswith(NOISE_ONLY):
            assert diff <= rel * scale, (f"{name}: difference {diff:.2e} > {rel:g} "
                                         f"x the model's largest weight norm {scale:.3f}")
        else:
            own = max(w.norm().item(), 1e-30)
            assert diff <= rel * own, f"{name}: relative difference {diff / own:.2e} > {rel:g}"


def losses(run_dir: pathlib.Path, key: str = "loss") -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row[key] for row in rows}  # a re-run step keeps its last value


def grad_norms(run_dir: pathlib.Path) -> dict[int, float]:
    """The global gradient norm before clipping: a uniform gradient-scale error changes it even
    where clipping to max_norm hides it in the parameters."""
    return losses(run_dir, "grad_norm")


@pytest.fixture(scope="module")
def single(recipes, env, tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("runs") / "one"
    done = train(recipes["clean"], run_dir, env, "--nproc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize(
    "mesh",
    [["--nproc", "2"], ["--nproc", "4", "--set", "parallel.ulysses=2"],
     ["--nproc", "4", "--set", "parallel.dp_replicate=2"]],
    ids=["fsdp-dp2", "fsdp-dp2-x-ulysses2", "hsdp-2x2"],
)
def test_n_steps_equal_one_process(mesh, recipes, env, single, tmp_path):
    run_dir = tmp_path / "run"
    done = train(recipes["clean"], run_dir, env, *mesh)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_params(exported(run_dir, env), exported(single, env), rel=1e-5)
    want = losses(single)
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    for step, loss in losses(run_dir).items():
        assert abs(loss - want[step]) <= 1e-5 * abs(want[step]), (step, loss, want[step])
    assert grad_norms(run_dir) == pytest.approx(grad_norms(single), rel=1e-4)


def test_rank_killed_mid_step_restarts_and_resumes(env, tmp_path):
    """Run A trains 4 steps; run B, the same recipe with `--max-restarts 1`, loses rank 1 (SIGKILL)
    at step 4: the launcher starts both ranks again and they resume from the step-2 checkpoint by
    themselves; the built-in token_budget batching (synthetic data, ulysses 2 on two ranks)
    continues the same data order, so losses, gradient norms and the final parameters equal A's."""
    recipe = tmp_path / "real.toml"
    recipe.write_text(textwrap.dedent(f'''
        include = ["{ROOT / "recipes" / "rules" / "modality-groups.toml"}"]
        [model]
        preset = "qwen2_5_vl_tiny"
        [data]
        num_samples = 64
        max_side = 56
        [train]
        max_steps = 4
        micro_batch_tokens = 256
        warmup_steps = 1
        checkpoint_every = 2
        [parallel]
        ulysses = 2
        [[rules]]
        guard = [{{ strategy = "finite" }}, {{ strategy = "kill", step = 4, rank = 1 }}]
    '''))
    a, b = tmp_path / "a", tmp_path / "b"
    clean = recipe.with_name("clean.toml")
    clean.write_text(recipe.read_text().replace(', { strategy = "kill", step = 4, rank = 1 }', ""))
    assert train(clean, a, env, "--nproc", "2").returncode == 0
    done = train(recipe, b, env, "--nproc", "2", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((b / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["start_step"] == 2  # resumed by itself
    rows = [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4]  # steps lost with the rank were dropped, then run again
    assert losses(b) == pytest.approx(losses(a), rel=1e-6)
    assert grad_norms(b) == pytest.approx(grad_norms(a), rel=1e-6)
    assert_same_params(exported(b, env), exported(a, env), rel=1e-6)


def test_checkpoint_saved_with_2_ranks_resumes_with_1(recipes, env, single, tmp_path):
    """Saved by 2 FSDP ranks at step 2, resumed by 1 rank (model and optimizer resharded): steps 3-4
    then equal one process that trained all 4 steps."""
    run_dir = tmp_path / "two-then-one"
    done = train(recipes["kill"], run_dir, env, "--nproc", "2")  # killed at step 4; newest checkpoint: step 2
    assert done.returncode != 0
    done = train(recipes["kill"], run_dir, env, "--nproc", "1", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_params(exported(run_dir, env), exported(single, env), rel=1e-5)


@pytest.mark.quick
def test_export_loads_in_transformers_with_the_same_logits(single, env):
    import transformers

    from model_helpers import build_model
    from weft.core.checkpoint.read import checkpoint_dirs, load_checkpoint_into
    from weft.core.commands.export import run_recipe

    exported(single, env)
    out = single.parent / f"{single.name}-export"
    model = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert isinstance(model, transformers.Qwen2_5_VLForConditionalGeneration)

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trained = build_model(run_recipe(single), device="cpu", seed=123)  # different init, then the checkpoint
        load_checkpoint_into(trained, checkpoint_dirs(single)[-1])
    finally:
        dist.destroy_process_group()
    want = trained.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name  # bit for bit
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)


def test_model_directory_loads_shard_by_shard(single, env, tmp_path):
    """model.path: built on the meta device, sharded (FSDP2 x Ulysses), each rank reading only
    its rows of each tensor; `weft check` against transformers' own from_pretrained."""
    exported(single, env)
    recipe = tmp_path / "from-dir.toml"
    recipe.write_text(textwrap.dedent(f'''
        include = ["{ROOT / "recipes" / "rules" / "modality-groups.toml"}"]
        [model]
        path = "{single.parent / f"{single.name}-export"}"
    '''))
    done = run_weft("check", str(recipe), "--world-size", "4", "--set", "parallel.ulysses=2", "--json", env=env,
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["ok"] and result["loss_ref"] < 5.5, result  # the trained weights (a fresh init gives ~5.75)
