"""train.optimizer: torch's AdamW, or torchao's with bf16 stochastic rounding.

Stochastic rounding keeps, on average, updates smaller than half a bf16 step, which
round-to-nearest loses every time; a run with it is reproducible from its seed and a
resumed run equals one never stopped (the rounding draws from torch's generator, which
checkpoints save).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from weft.core.errors import WeftError
from weft.core.optimizer import make_optimizer


def _recipe(optimizer: str) -> types.SimpleNamespace:
    train = types.SimpleNamespace(optimizer=optimizer, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.0,
                                  warmup_steps=0, max_steps=100, min_lr_ratio=1.0)
    return types.SimpleNamespace(train=train)


def _twenty_steps(optimizer: str) -> torch.Tensor:
    model = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)  # 4,096 weights
    torch.nn.init.ones_(model.weight)
    opt, _ = make_optimizer(_recipe(optimizer), model)
    for _ in range(20):
        model.weight.grad = torch.ones_like(model.weight)
        opt.step()
    return model.weight.detach().float()


def test_stochastic_rounding_keeps_updates_smaller_than_half_a_bf16_step():
    # Each Adam step moves a weight of 1.0 by ~lr = 1e-3, under half the bf16 spacing below 1.0
    # (2^-8): round-to-nearest gives 1.0 back every time; stochastic rounding moves the mean
    # by the 20 updates (0.02) and lands every weight on one of the two bf16 neighbours' grid.
    torch.manual_seed(0)
    plain = _twenty_steps("adamw")
    assert torch.equal(plain, torch.ones_like(plain))
    rounded = _twenty_steps("adamw_bf16_sr")
    assert abs(rounded.mean().item() - (1 - 20e-3)) < 2e-3
    assert torch.equal(rounded, rounded.to(torch.bfloat16).float()) and rounded.unique().numel() > 1


def test_without_torchao_the_choice_is_a_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(WeftError, match=r"'adamw_bf16_sr' needs torchao \(pip install 'weft\[sr\]'\)"):
        make_optimizer(_recipe("adamw_bf16_sr"), torch.nn.Linear(2, 2))


RECIPE = textwrap.dedent('''
    [model]
    preset = "qwen2_text_tiny"
    [data]
    source = "synthetic"
    tokens = 64
    num_samples = 64
    [train]
    max_steps = 6
    micro_batch_tokens = 64
    checkpoint_every = 2
    keep_checkpoints = 5
    optimizer = "adamw_bf16_sr"
    [parallel]
    nproc = 1
    [[rules]]
    shard = { strategy = "fsdp2", storage_dtype = "bfloat16" }
''')


def test_stochastic_rounding_run_resumes_exactly(tmp_path):
    (tmp_path / "sr.toml").write_text(RECIPE)

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "weft", "run", "sr.toml", "--run-dir", "run", *extra],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)

    def losses() -> dict[int, float]:
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, rows)}

    assert (done := run()).returncode == 0, done.stderr[-3000:]
    whole = losses()
    for step in ("step-4", "step-6"):  # as if the run had died after step 2's checkpoint
        shutil.rmtree(tmp_path / "run" / "checkpoints" / step)
    assert (done := run("--resume")).returncode == 0, done.stderr[-3000:]
    assert losses() == whole and len(set(whole.values())) == 6
    assert pathlib.Path(tmp_path / "run" / "summary.json").is_file()
