"""`weft run` end to end: the embedded default on 2 gloo ranks, the run directory, resume, a run
directory that holds a run, and a working folder whose code must not run."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-vl.toml"


def weft_process(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """The real launcher, as a user's `weft run` starts its 2 ranks (the other commands: the in-process
    ``weft`` fixture, whose ranks are forked)."""
    return subprocess.run([sys.executable, "-m", "weft", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


#: Modules a folder someone unpacked might hold, each shadowing what weft or its ranks import;
#: importing any of them writes its marker.
PLANTED = ("pluggy", "torch", "weft", "transformers", "structlog", "planted_plugin")


def plant(folder: pathlib.Path, names: tuple[str, ...] = PLANTED) -> list[pathlib.Path]:
    """``folder`` as a hostile working folder: shadowing modules and a weft plugin's dist-info
    (an entry point in group ``weft``), each leaving a marker when imported; the markers."""
    markers = []
    for name in names:
        marker = folder / f"{name}.imported"
        (folder / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                           f"raise ImportError('planted {name} ran')\n")
        markers.append(marker)
    info = folder / "planted_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[weft]\nplanted = planted_plugin\n")
    return markers


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> tuple[pathlib.Path, list[pathlib.Path]]:
    folder = tmp_path_factory.mktemp("unpacked")
    return folder, plant(folder)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, hostile) -> pathlib.Path:
    """The 2-rank run, started as a user starts it (the console script) from a folder full of
    planted modules: the parent has no working folder on its path, and its ranks are started
    with ``python -P`` (core/run/launch.py), whose ``-m`` would otherwise put it first."""
    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    script = pathlib.Path(sys.executable).parent / "weft"
    assert script.is_file(), f"{script}: the console script `pip install -e .` makes"
    done = subprocess.run([str(script), "run", str(TINY), "--set", "train.max_steps=12", "--set",
                           "train.checkpoint_every=6", "--run-dir", str(run_dir)], cwd=hostile[0], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir


def test_nothing_in_the_working_folder_is_imported(tiny_run, hostile, tmp_path):
    """The run trained from the planted folder (tiny_run) without importing any planted module
    or plugin, in the launcher or either rank. `python -m weft plugins` (``-m`` puts the folder
    first on the path, weft/__main__.py takes it off) lists and loads what the ranks load: no
    planted plugin. (A ``weft.py`` there shadows ``python -m weft`` itself, before any weft code
    runs: Python's own rule, which the console script and ``python -P`` escape.)"""
    folder, markers = hostile
    assert json.loads((tiny_run / "summary.json").read_text())["status"] == "completed"
    assert [m.name for m in markers if m.exists()] == []
    markers = plant(tmp_path, tuple(name for name in PLANTED if name != "weft"))
    listed = weft_process("plugins", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "planted" not in listed.stdout and "weft.plugins.adapter" in listed.stdout, listed.stdout[:2000]
    assert [m.name for m in markers if m.exists()] == []


def test_run_writes_the_run_directory(tiny_run):
    for name in ("metrics.jsonl", "summary.json", "log.jsonl", "recipe.json", "plan.json"):
        assert (tiny_run / name).is_file(), name
    rows = read_metrics(tiny_run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for row in rows:
        assert {"step", "loss", "tokens", "tokens_per_s", "lr", "grad_norm"} <= row.keys()
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0
        # Where the step's time went: the three phases fit inside it.
        phases = row["forward_s"] + row["backward_s"] + row["optimizer_s"]
        assert 0 < phases <= row["step_s"] and min(row["forward_s"], row["backward_s"], row["optimizer_s"]) > 0
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert {"steps", "final_loss", "tokens", "tokens_per_s", "skipped_samples", "wall_s"} <= summary.keys()
    assert summary["steps"] == 12 and summary["world_size"] == 2
    assert summary["tokens"] == sum(r["tokens"] for r in rows)
    # mRoPE: images advance positions by their side, so the largest id stays below the longest row
    assert 0 < summary["largest_position"] < 1024 and summary["rope_context"] == 4096
    events = [json.loads(line)["event"] for line in (tiny_run / "log.jsonl").read_text().splitlines()]
    assert "run.start" in events and "run.end" in events and "shard.fsdp2" in events
    assert (tiny_run / "logs" / "rank-1.jsonl").is_file()


def test_run_loss_falls(tiny_run):
    losses = [r["loss"] for r in read_metrics(tiny_run)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_run_keeps_checkpoints(tiny_run):
    names = sorted(p.name for p in (tiny_run / "checkpoints").iterdir())
    assert names == ["step-12", "step-6"]


def test_resume_continues_from_newest_checkpoint(weft, tiny_run, tmp_path):
    """Steps 13-14 after 1-12; the summary's largest position id (what `weft export` records as
    the context the model saw) is the whole run's, not only the resumed steps' (smaller images
    after the resume: their own largest, 95, is below the first segment's)."""
    first = json.loads((tiny_run / "summary.json").read_text())["largest_position"]
    meta = lambda step: json.loads((tiny_run / "checkpoints" / f"step-{step}" / "meta.json").read_text())  # noqa: E731
    assert meta(12)["largest_position"] == first  # the ranks' largest, kept with the checkpoint
    done = weft("run", str(TINY), "--set", "train.max_steps=14", "--set", "data.max_side=56", "--run-dir",
                str(tiny_run), "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = read_metrics(tiny_run)
    assert [r["step"] for r in rows][-2:] == [13, 14]
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert summary["start_step"] == 12
    assert summary["largest_position"] == meta(14)["largest_position"] == first


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_into_a_finished_run_is_refused_or_moves_it_aside(weft, tiny_run, tmp_path):
    """Without --resume, a run directory holding a finished run is exit 2 naming its state, its
    last checkpoint and the ways on; nothing in it changes. With --overwrite the old run's files
    all move, byte for byte, to a folder beside it, and the new run's checkpoint is its own (at
    0149418 the new run appended to metrics.jsonl and keep_checkpoints deleted its own step 2)."""
    old = tmp_path / "finished"
    shutil.copytree(tiny_run, old)
    before = _files(old)
    done = weft("run", str(TINY), "--nproc", "1", "--set", "train.max_steps=2", "--run-dir", str(old), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = max(int(p.name.removeprefix("step-")) for p in (old / "checkpoints").iterdir())
    for part in (f"--run-dir: {old} holds a completed run", f"last checkpoint step-{last}", "--resume",
                 "another --run-dir", "--overwrite"):
        assert part in done.stderr, (part, done.stderr)
    assert _files(old) == before

    done = weft("run", str(TINY), "--nproc", "1", "--set", "train.max_steps=2", "--set", "train.keep_checkpoints=1",
                "--run-dir", str(old), "--overwrite", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (aside,) = tmp_path.glob("finished.old-*")
    assert f"moved to {aside}" in done.stderr
    assert _files(aside) == before
    assert [r["step"] for r in read_metrics(old)] == [1, 2]
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step-2"]
    summary = json.loads((old / "summary.json").read_text())
    assert summary["last_checkpoint"] == "step-2" and summary["start_step"] == 0
    done = weft("run", str(TINY), "--run-dir", str(old), "--overwrite", "--resume", cwd=tmp_path)
    assert done.returncode == 2 and "--overwrite" in done.stderr and "Traceback" not in done.stderr


def test_resume_without_checkpoint_is_a_user_error(weft, tmp_path):
    done = weft("run", str(TINY), "--nproc", "1", "--run-dir", str(tmp_path / "empty"), "--resume", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "no checkpoint" in done.stderr and "Traceback" not in done.stderr


def test_missing_data_file_fails_before_launch(weft, tmp_path):
    done = weft("run", str(TINY), "--set", "data.source='jsonl'", "--set", "data.path='nope.jsonl'",
                "--run-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "data.path" in done.stderr and "nope.jsonl" in done.stderr and "Traceback" not in done.stderr


def test_plan_lists_every_attention_module_of_both_towers(weft, tmp_path):
    done = weft("plan", str(TINY), "--world-size", "4", "--explain", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for path in (
        "model.visual.blocks.0.attn",
        "model.visual.blocks.1.attn",
        "model.language_model.layers.0.self_attn",
        "model.language_model.layers.1.self_attn",
    ):

        rows = [line for line in lines if path + " " in line and "attention" in line]
        assert rows, path
        # Both "auto": vision on whole images (one kernel call per block where flash-attn-4 is
        # installed, else SDPA); text chosen from the mesh.
        assert "auto" in rows[0] and "defaults.toml:" in rows[0]
    assert "dp_shard=4" in done.stdout


def test_plan_json_is_parseable(weft, tmp_path):
    done = weft("plan", str(TINY), "--world-size", "2", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["mesh"]["dp_shard"] == 2
    vision = [m for m in plan["modules"] if m["modality"] == "vision" and m["kind"] == "attention"]
    # The default rule's 'auto', resolved in the plan: whole images, one kernel call per block
    # (vision_local) where flash-attn-4 is installed, else SDPA.
    assert len(vision) == 2 and all(m["decisions"]["attention"]["resolved_from"] == "auto" for m in vision)
    assert {m["decisions"]["attention"]["strategy"] for m in vision} <= {"sdpa", "vision_local"}


def test_unknown_model_type_is_a_user_error_listing_the_families(weft, tmp_path):
    """A local model directory whose config.json names a model_type no installed family
    handles: exit 2 before any process starts, naming the file's model_type, the key and
    every family installed; no traceback."""
    model_dir = tmp_path / "mystery-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "mystery_vl", "hidden_size": 8}))
    recipe = tmp_path / "mystery.toml"
    recipe.write_text('[model]\npath = "mystery-model"\n')
    for command in (["run", str(recipe)], ["plan", str(recipe)], ["check", str(recipe)]):
        done = weft(*command, cwd=tmp_path)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        message = done.stderr
        assert f"{recipe} (model.path)" in message and "model_type 'mystery_vl'" in message, message
        for family in ("qwen2_5_vl (qwen2_5_vl)", "qwen2_vl (qwen2_vl)", "qwen3_vl (qwen3_vl)", "causal_lm (qwen2"):
            assert family in message, message


def test_a_preset_without_processor_reading_jsonl_is_a_user_error(weft, tmp_path):
    """The 7B preset ships no tokenizer: reading chat data with it stops before any rank starts
    (exit 2, naming model.processor and the way out: long synthetic samples need no tokenizer)."""
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "hello"}]}) + "\n")
    recipe = tmp_path / "big.toml"
    recipe.write_text('[model]\npreset = "qwen2_5_vl_7b"\n[data]\nsource = "jsonl"\npath = "chat.jsonl"\n')
    done = weft("run", str(recipe), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{recipe} (model.processor)" in done.stderr and "data.tokens" in done.stderr, done.stderr
    done = weft("plan", str(recipe), "--positions", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "model.processor" in done.stderr, done.stderr


@pytest.mark.quick
def test_a_run_s_recipe_keeps_its_folder_from_another_working_folder(tmp_path, monkeypatch):
    """recipe.json names the recipe's file by its absolute path: `weft run examples/x/r.toml` from
    one folder, then `weft export RUN` from another, still reads model.path (relative to the
    recipe) from the recipe's folder; a relative source sent it to the new working folder."""
    from weft.core.commands.export import run_recipe
    from weft.core.commands.run import recipe_record
    from weft.core.recipe import Recipe

    (tmp_path / "examples" / "x").mkdir(parents=True)
    (tmp_path / "examples" / "x" / "r.toml").write_text('[model]\npath = "data/model.gguf"\n')
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    recipe = Recipe.from_toml("examples/x/r.toml")
    (run / "recipe.json").write_text(json.dumps(recipe_record(recipe, [])))
    monkeypatch.chdir(run)
    want = (tmp_path / "examples" / "x" / "data" / "model.gguf").resolve()
    assert run_recipe(run).relative("data/model.gguf") == want
