"""`weft report`: a PNG (checked for size and content) and an HTML page from two tiny runs,
one of them resumed (repeated steps count once) and one aborted (no summary, a line cut
short); skipped steps and checkpoints marked; MFU for a run on a known GPU; mistakes are
exit-2 messages."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from PIL import Image

from weft_cli import run_weft

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, pathlib.Path]:
    base = tmp_path_factory.mktemp("report")
    first = base / "first"
    done = run_weft("run", str(ROOT / "recipes" / "tiny-vl.toml"), "--nproc", "1", "--run-dir", str(first),
                    "--set", "train.max_steps=4", "--set", "data.num_samples=64",
                    "--set", "train.checkpoint_every=2", cwd=base)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    # A resumed run: steps 3-4 ran again after a restart from step 2 (the second time counts),
    # then step 5 was skipped by a guard.
    resumed = base / "resumed"
    shutil.copytree(first, resumed)
    again = [dict(r, loss=r["loss"] - 0.5) for r in rows[2:]] + [dict(rows[-1], step=5, skipped=True, loss=9.0)]
    with (resumed / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in again)
    # An aborted run: killed mid-write, no summary.
    aborted = base / "aborted"
    shutil.copytree(first, aborted)
    (aborted / "summary.json").unlink()
    with (aborted / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 4.')
    return {"first": first, "resumed": resumed, "aborted": aborted}


def test_png_and_html_of_two_runs(weft, runs, tmp_path):
    done = weft("report", str(runs["first"]), str(runs["resumed"]), "--out", str(tmp_path / "r.png"))
    assert done.returncode == 0, done.stderr[-3000:]
    image = Image.open(tmp_path / "r.png").convert("RGB")
    assert image.size[0] >= 800 and (tmp_path / "r.png").stat().st_size > 20_000
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # curves, labels and marks, not a blank canvas
    white = max(count for count, colour in colours if colour == (255, 255, 255))
    assert white < 0.97 * image.size[0] * image.size[1]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("first: completed; 4 steps (last 4)") and "checkpoints at [2, 4]" in lines[0]
    # The resumed run: steps 3 and 4 once each (their second run), step 5 skipped.
    assert lines[1].startswith("resumed: completed; 5 steps (last 5)") and "1 skipped steps" in lines[1]
    page = weft("report", str(runs["first"]), str(runs["aborted"]), "--out", str(tmp_path / "r.html"))
    assert page.returncode == 0, page.stderr[-3000:]
    text = (tmp_path / "r.html").read_text()
    assert "<img src='data:image/png;base64," in text and "first: completed" in text
    assert "aborted: no summary (still running, or killed); 4 steps" in text


def test_repeated_steps_count_once_and_mfu_on_a_known_gpu(runs, tmp_path):
    from weft.core.commands.report import read_run

    resumed = read_run(runs["resumed"])
    assert [r["step"] for r in resumed["rows"]] == [1, 2, 3, 4, 5]
    first = read_run(runs["first"])
    assert resumed["rows"][2]["loss"] == pytest.approx(first["rows"][2]["loss"] - 0.5)
    assert "mfu" not in first["rows"][0]  # a CPU run: no MFU
    gpu = tmp_path / "gpu"
    shutil.copytree(runs["first"], gpu)
    log = [json.loads(line) for line in (gpu / "log.jsonl").read_text().splitlines()]
    for event in log:
        if event.get("event") == "run.start":
            event["gpu"] = "NVIDIA H200"
    (gpu / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    row = read_run(gpu)["rows"][1]
    # 6 N + 6 layers hidden L: the tiny preset (no embedding), at its micro-batch length.
    from weft.core.commands.export import run_recipe
    from weft.core.plugin_manager import plugin_manager_from_env

    recipe = run_recipe(gpu)
    model = plugin_manager_from_env().models.for_recipe(recipe).build(recipe, device="meta", seed=0)
    text = model.config.get_text_config()
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name and "visual" not in name)
    if getattr(model.config, "tie_word_embeddings", False):
        n += model.get_output_embeddings().weight.numel()
    flops = 6 * n + 6 * text.num_hidden_layers * text.hidden_size * recipe.train.seq_len
    assert row["mfu"] == pytest.approx(flops * row["tokens_per_s"] / 989e12)


@pytest.mark.parametrize("args, message", [
    (["nowhere"], "nowhere: nowhere has no metrics.jsonl"),
    (["RUN", "--out", "r.pdf"], "--out: --out r.pdf: the report is written as .png or .html"),
])
def test_mistakes_are_messages(weft, runs, args, message, tmp_path):
    done = weft("report", *[str(runs["first"]) if a == "RUN" else a for a in args], cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
