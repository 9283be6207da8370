"""Optimizers by rule (plugins/optimizer.py): adamw_sr (the default), adamw, adamw_8bit.

adamw_sr keeps, on average, updates smaller than half a bf16 step, which round-to-nearest
loses every time; on float32 weights it is torch's AdamW, number for number. Per-module
rules give param groups their own peak learning rate and weight decay, equal to a
hand-built torch optimizer with those groups. A run is reproducible from its seed and a
resumed run equals one never stopped (the rounding's seed comes from torch's generator,
which checkpoints save).
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import sys
import textwrap

import pytest
import torch

from model_helpers import build_model, optimizer_for
from weft.core.errors import PlanError
from weft.core.recipe import Recipe
from weft.strategies.optim.adamw_sr import AdamWSR
from weft.strategies.optim.stochastic_round import adamw_step_, below_half_step, stochastic_round_


def _twenty_steps(optimizer: torch.optim.Optimizer, weight: torch.nn.Parameter) -> torch.Tensor:
    for _ in range(20):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
    return weight.detach().float()


@pytest.mark.quick
def test_stochastic_rounding_keeps_updates_smaller_than_half_a_bf16_step():
    # Each Adam step moves a weight of 1.0 by ~lr = 1e-3, under half the bf16 spacing below 1.0
    # (2^-8): round-to-nearest gives 1.0 back every time; stochastic rounding moves the mean
    # by the 20 updates (0.02) and lands every weight on the bf16 grid.
    torch.manual_seed(0)
    plain = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    assert torch.equal(_twenty_steps(torch.optim.AdamW([plain], lr=1e-3, weight_decay=0.0), plain),
                       torch.ones(64, 64))
    rounded = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    got = _twenty_steps(AdamWSR([rounded], lr=1e-3), rounded)
    assert abs(got.mean().item() - (1 - 20e-3)) < 2e-3
    assert torch.equal(got, got.to(torch.bfloat16).float()) and got.unique().numel() > 1


@pytest.mark.quick
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.full((200_000,), 1.0 + 2**-10, dtype=torch.float32)  # a quarter of the way from 1 to the next bf16
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(out, x.clone(), generator=torch.Generator().manual_seed(0))
    values = set(out.float().unique().tolist())
    assert values == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - (1.0 + 2**-10)) < 2e-5  # the mean is kept (a 4-sigma bound)
    negative = torch.empty_like(out)
    stochastic_round_(negative, -x, generator=torch.Generator().manual_seed(1))
    assert abs(negative.float().mean().item() + (1.0 + 2**-10)) < 2e-5


@pytest.mark.quick
def test_below_half_step():
    w = torch.tensor([1.0, 1.0, 0.02, 0.0], dtype=torch.bfloat16)  # bf16 spacing at 1.0: 2^-7; at 0.02: 2^-13
    u = torch.tensor([2**-9, 2**-7, 1e-5, 1e-30])
    assert below_half_step(w, u).tolist() == [True, False, True, False]


@pytest.mark.quick
def test_float32_weights_step_exactly_as_torch_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    groups = lambda m: [{"params": m[0].parameters(), "lr": 1e-2, "weight_decay": 0.1},  # noqa: E731
                        {"params": m[1].parameters(), "lr": 3e-3, "weight_decay": 0.0}]
    ours, theirs = AdamWSR(groups(model), lr=1e-3, betas=(0.9, 0.95)), \
        torch.optim.AdamW(groups(twin), lr=1e-3, betas=(0.9, 0.95), foreach=True)
    for _ in range(5):
        x = torch.randn(4, 8)
        for m, opt in ((model, ours), (twin, theirs)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.quick
def test_the_bf16_path_does_torch_adamw_arithmetic_in_float32():
    """With float32 storage the per-tensor step (no rounding happens) equals torch's AdamW."""
    torch.manual_seed(0)
    p = torch.randn(1000)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    m, v = torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 4):
        g = torch.randn(1000)
        ref.grad = g.clone()
        opt.step()
        adamw_step_(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, seed=step)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


PRESET_VL = {"model": {"preset": "qwen2_5_vl_tiny"}, "train": {"lr": 1e-5, "weight_decay": 0.01}}


@pytest.mark.quick
def test_per_module_learning_rates_equal_a_hand_built_optimizer():
    """The bundled three-rate rules (LLM 1e-5, vision tower 2e-5, merger 1e-4): the groups, their
    settings and five steps equal torch's AdamW over param groups made by hand."""
    recipe = Recipe.from_dict({**PRESET_VL, "include": ["rules/qwen2.5-vl-three-rates.toml"]})
    model = build_model(recipe)
    twin = copy.deepcopy(model)
    optimizer, scheduler = optimizer_for(recipe, model)
    visual = twin.model.visual
    merger = {id(p) for p in visual.merger.parameters()}
    tower = [p for p in visual.parameters() if id(p) not in merger]
    llm = [p for n, p in twin.named_parameters() if not n.startswith("model.visual.")]
    by_lr = sorted((g["initial_lr"], len(g["params"])) for g in optimizer.param_groups)  # peaks: before warmup
    assert by_lr == sorted([(1e-5, len(llm)), (2e-5, len(tower)), (1e-4, len(list(visual.merger.parameters())))])
    hand = torch.optim.AdamW([{"params": llm, "lr": 1e-5}, {"params": tower, "lr": 2e-5},
                              {"params": list(visual.merger.parameters()), "lr": 1e-4}],
                             lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01, foreach=True)
    hand_schedule = torch.optim.lr_scheduler.LambdaLR(hand, scheduler.lr_lambdas[0])
    ids = torch.randint(0, 200, (1, 32))
    for _ in range(5):
        for m, opt, sched in ((model, optimizer, scheduler), (twin, hand, hand_schedule)):
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.quick
def test_lr_scale_and_two_strategies():
    recipe = Recipe.from_dict({**PRESET_VL, "rules": [
        {"when": {"modality": "projector"}, "optimizer": {"lr_scale": 10.0, "weight_decay": 0.0}}]})
    optimizer, _ = optimizer_for(recipe, build_model(recipe))
    assert sorted((g["initial_lr"], g["weight_decay"]) for g in optimizer.param_groups) == [(1e-5, 0.01), (1e-4, 0.0)]
    mixed = Recipe.from_dict({**PRESET_VL, "rules": [
        {"when": {"modality": "projector"}, "optimizer": {"strategy": "adamw"}}]})
    two = r"optimizer rules choose two strategies, 'adamw_sr' .* and 'adamw' \(<memory>#rule1\)"
    with pytest.raises(PlanError, match=two):
        optimizer_for(mixed, build_model(mixed))


@pytest.mark.quick
def test_without_torchao_the_8bit_choice_is_a_plan_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "train": {"optimizer": "adamw_8bit"}})
    with pytest.raises(PlanError, match=r"'adamw_8bit' needs torchao \(pip install 'weft\[sr\]'\)"):
        optimizer_for(recipe, build_model(recipe))


def _train_200(*, storage: torch.dtype, optimizer: str) -> list[float]:
    """The tiny text model on one fixed batch, 200 steps at lr 1e-5: its losses."""
    recipe = Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}, "train": {"lr": 1e-5, "seed": 0}})
    model = build_model(recipe, seed=0).to(storage)
    params = [p for p in model.parameters()]
    opt = AdamWSR(params, lr=1e-5, betas=(0.9, 0.95)) if optimizer == "adamw_sr" else \
        torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(200):
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_200_steps_at_lr_1e5_in_bf16_follow_float32_and_round_to_nearest_does_not():
    reference = _train_200(storage=torch.float32, optimizer="adamw")
    rounded = _train_200(storage=torch.bfloat16, optimizer="adamw_sr")
    nearest = _train_200(storage=torch.bfloat16, optimizer="adamw")
    fell = reference[0] - reference[-1]
    assert fell > 0.05, reference[::40]  # the float32 run learns at this rate
    assert abs(rounded[-1] - reference[-1]) < 0.01 * reference[-1], (rounded[-1], reference[-1])
    assert abs((rounded[0] - rounded[-1]) - fell) < 0.1 * fell, (rounded[::40], reference[::40])
    # Round-to-nearest loses most updates of 0.02-sized weights (half a bf16 step: ~6e-5 > lr).
    assert nearest[0] - nearest[-1] < 0.5 * fell, (nearest[::40], reference[::40])


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
    lr = 1e-5
    [parallel]
    nproc = 1
    [[rules]]
    shard = { strategy = "fsdp2", storage_dtype = "bfloat16" }
''')


def test_stochastic_rounding_run_resumes_exactly_and_the_update_guard_speaks_only_for_nearest(weft, tmp_path):
    (tmp_path / "sr.toml").write_text(RECIPE)

    def run(*extra: str, run_dir: str = "run"):
        return weft("run", "sr.toml", "--run-dir", run_dir, *extra, cwd=tmp_path)

    def losses() -> dict[int, float]:
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, rows)}

    def guard_events(run_dir: str) -> list[dict]:
        rows = map(json.loads, (tmp_path / run_dir / "log.jsonl").read_text().splitlines())
        return [r for r in rows if r.get("event", "").startswith("guard.update")]

    assert (done := run()).returncode == 0, done.stderr[-3000:]
    whole = losses()
    (report,) = guard_events("run")  # the default (adamw_sr): reported at step 2, no warning
    assert report["event"] == "guard.update" and report["rounding"] == "stochastic" and report["step"] == 2
    for step in ("step-4", "step-6"):  # as if the run had died after step 2's checkpoint
        shutil.rmtree(tmp_path / "run" / "checkpoints" / step)
    assert (done := run("--resume")).returncode == 0, done.stderr[-3000:]
    assert losses() == whole and len(set(whole.values())) == 6
    assert pathlib.Path(tmp_path / "run" / "summary.json").is_file()
    # Round-to-nearest forced: the guard warns, with the share it measured and the rule behind it.
    assert (done := run("--set", "train.optimizer=adamw", "--set", "train.max_steps=2", run_dir="rtn")).returncode == 0
    (warning,) = guard_events("rtn")
    assert warning["event"] == "guard.update.lost" and warning["below_half_step"] >= 0.8
    assert "train.optimizer" in warning["rule"] and warning["lr"] > 0
