"""`[eval]`: a run's held-out loss every few steps (``eval_loss`` in metrics.jsonl), the loss
`weft eval` gives on that step's checkpoint, on one rank and on two; the training steps the
same with it as without (its batching and forwards draw nothing from the run's streams)."""

from __future__ import annotations

import json

import pytest

TEXT = ('[model]\npreset = "qwen2_text_tiny"\n[data]\nsource = "text"\npath = "<stdlib>/json/*.py"\ntokens = 256\n'
        'num_samples = 48\nskip_samples = 8\n[train]\nmicro_batch_tokens = 1024\nmax_steps = 4\nlr = 3e-3\n'
        'warmup_steps = 0\nprecision = "fp32"\ncheckpoint_every = 2\n[parallel]\nnproc = 1\n')
EVAL = '[eval]\nevery = 2\n[eval.data]\nskip_samples = 0\nnum_samples = 8\n'
HELD_OUT = ("--set", "data.skip_samples=0", "--set", "data.num_samples=8", "--json")


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_held_out_loss_of_a_run_is_weft_evals(weft, tmp_path):
    (tmp_path / "plain.toml").write_text(TEXT)
    (tmp_path / "eval.toml").write_text(TEXT + EVAL)
    for name in ("plain", "eval"):
        done = weft("run", f"{name}.toml", "--run-dir", name, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    plain, evaluated = _rows(tmp_path / "plain"), _rows(tmp_path / "eval")
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in plain]  # the same steps, bit for bit
    assert [r["step"] for r in evaluated if "eval_loss" in r] == [2, 4]
    assert all(r["eval_tokens"] == 8 * 255 for r in evaluated if "eval_loss" in r)  # 8 samples of 256
    for row in (r for r in evaluated if "eval_loss" in r):
        done = weft("eval", "eval.toml", "--run-dir", "eval", "--step", str(row["step"]), *HELD_OUT, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert row["eval_loss"] == pytest.approx(json.loads(done.stdout)["loss"], rel=1e-12)
    first, last = (r["eval_loss"] for r in evaluated if "eval_loss" in r)
    assert last < first  # held out, and still it falls: real text
    report = weft("report", "eval", "--out", "report.png", cwd=tmp_path)
    assert report.returncode == 0 and f"held-out loss {last:.4f} at step 4" in report.stdout, report.stderr[-2000:]
    # Two data-parallel ranks: each evaluates its share of the held-out rounds, the loss the same.
    done = weft("run", "eval.toml", "--run-dir", "two", "--nproc", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    two = [r for r in _rows(tmp_path / "two") if "eval_loss" in r]
    check = weft("eval", "eval.toml", "--run-dir", "two", *HELD_OUT, cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-3000:]
    assert two[-1]["eval_loss"] == pytest.approx(json.loads(check.stdout)["loss"], rel=1e-6)
    assert two[-1]["eval_tokens"] == 8 * 255


@pytest.mark.parametrize(("text", "message"), [
    (TEXT + "[eval.data]\nnum_samples = 8\n", "[eval] gives no every"),
    (TEXT + "[eval]\nevery = 2\n[eval.data]\nnum_sample = 8\n", "unknown key 'num_sample'"),
    (TEXT + "[eval]\nevery = -1\n", "eval.every"),
])
def test_mistakes_are_messages(weft, tmp_path, text, message):
    (tmp_path / "t.toml").write_text(text)
    done = weft("plan", "t.toml", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in " ".join(done.stderr.split()) and "t.toml" in done.stderr


def test_the_plan_says_what_is_held_out_and_set_turns_it_off(weft, tmp_path):
    (tmp_path / "t.toml").write_text(TEXT + EVAL)
    done = weft("plan", "t.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("held-out evaluation every 2 steps and after the last: [data] with num_samples = 8, skip_samples = 0"
            in " ".join(done.stdout.split()))
    off = weft("plan", "t.toml", "--set", "eval.every=0", cwd=tmp_path)
    assert off.returncode == 0 and "held-out" not in off.stdout, off.stderr[-2000:]
    nested = weft("plan", "t.toml", "--set", "eval.data=1", cwd=tmp_path)
    assert nested.returncode == 2 and "unknown key 'data'" in nested.stderr and "Accepted: every" in nested.stderr


def test_the_best_checkpoint_outlives_the_rotation(tmp_path):
    """checkpoints/best.json names the checkpoint of the lowest held-out loss: the rotation keeps
    it beside the newest ``keep`` (and lets it go once another is named)."""
    from weft.core.run import checkpoint

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / checkpoint.MANIFEST).write_text("{}")
    entry = checkpoint.mark_best(tmp_path, step=2, eval_loss=1.5, rank=0, keep=1)
    assert entry == checkpoint.best(tmp_path) == {"step": 2, "checkpoint": "step-2", "eval_loss": 1.5}
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-2", "step-6"]
    checkpoint.mark_best(tmp_path, step=6, eval_loss=1.2, rank=0, keep=1)
    assert [p.name for p in checkpoint.checkpoint_dirs(tmp_path)] == ["step-6"]
    # Which held-out losses make a new best: a finite one below the best so far, or the first.
    from weft.core.train.loop import _better

    best = {"eval_loss": 1.2}
    assert _better(1.0, than=best) and _better(5.0, than=None)
    assert not _better(1.3, than=best) and not _better(float("nan"), than=None) and not _better(None, than=best)


def test_keep_best_names_the_checkpoint_of_the_lowest_held_out_loss(weft, tmp_path):
    recipe = (TEXT.replace("checkpoint_every = 2", "checkpoint_every = 2\nkeep_checkpoints = 1")
              + EVAL.replace("every = 2\n", "every = 2\nkeep_best = true\n"))
    (tmp_path / "t.toml").write_text(recipe)
    done = weft("run", "t.toml", "--run-dir", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    held = {r["step"]: r["eval_loss"] for r in _rows(tmp_path / "run") if "eval_loss" in r}
    step = min(held, key=held.get)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["best_checkpoint"] == {"step": step, "checkpoint": f"step-{step}", "eval_loss": held[step]}
    assert (tmp_path / "run" / "checkpoints" / f"step-{step}").is_dir()
    bad = weft("plan", "t.toml", "--set", "train.checkpoint_every=3", cwd=tmp_path)
    assert bad.returncode == 2 and "must be a positive multiple of eval.every" in " ".join(bad.stderr.split())
