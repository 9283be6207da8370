"""Fault injection: each test is named after its fault and shows that nothing is lost.

Runs go through `weft run` (one rank, a tiny text model, 64-token synthetic samples: a
run is a few seconds); the disk-full case is in-process, with DCP's writer made to fail.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from fault_runs import FAST, rows


def weft_process(*args: str, cwd: pathlib.Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weft", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


@pytest.fixture
def recipe(tmp_path) -> pathlib.Path:
    path = tmp_path / "fast.toml"
    path.write_text(FAST)
    return path


def test_truncated_newest_checkpoint_falls_back(weft, trained, recipe, tmp_path):
    shard = trained / "checkpoints" / "step-8" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    done = weft("run", str(recipe), "--run-dir", str(trained), "--resume", "--set", "train.max_steps=10", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from step-6: passed over step-8: __0_0.distcp has" in done.stderr
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["start_step"] == 6 and summary["status"] == "completed"
    # The rows of steps 7 and 8 from before were dropped: each step once, in order.
    assert [r["step"] for r in rows(trained)] == list(range(1, 11))


def test_no_usable_checkpoint_is_one_message(weft, trained, recipe, tmp_path):
    for checkpoint in (trained / "checkpoints").iterdir():
        (checkpoint / "meta.json").write_text("{")
    done = weft("run", str(recipe), "--run-dir", str(trained), "--resume", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no usable checkpoint" in done.stderr and "step-8:" in done.stderr and "step-2:" in done.stderr


@pytest.mark.quick
def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """One paragraph: the folder, the OS's error, the state's real size and the space free; no
    traceback (DCP wraps a failed write in every rank's traceback)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from weft.core.run import checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        kw = dict(run_dir=tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, rank=0, keep=3)
        good = checkpoint.save(step=1, **kw)

        def full_disk(self, plan, planner):  # inside dcp.save, which wraps it as a real write's failure
            (pathlib.Path(self.path) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
        with pytest.raises(checkpoint.CheckpointError) as caught:
            checkpoint.save(step=2, **kw)
        message = str(caught.value)
        tensors = [*model.parameters(),
                   *(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
        size = sum(t.numel() * t.element_size() for t in tensors)
        assert "\n" not in message and "Traceback" not in message and "CheckpointException" not in message
        assert message.startswith(f"{tmp_path / 'checkpoints' / '.tmp-step-2'}: saving the step-2 checkpoint "
                                  "failed: No space left on device (errno 28, ENOSPC). ")
        assert f"The state being saved is {size} bytes (every rank's share) and " in message
        assert " are free on that disk" in message and f"{good} is intact" in message
        assert not (tmp_path / "checkpoints" / ".tmp-step-2").exists()
        assert checkpoint.checkpoint_dirs(tmp_path) == [good] and checkpoint.verify(good) is None
    finally:
        dist.destroy_process_group()


def test_two_runs_into_one_directory(recipe, tmp_path):
    """A live holder: exit 2 naming it. A holder that is gone: taken over with a warning."""
    import socket

    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    lock = run_dir / "run.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "earlier"}))
    done = weft_process("run", str(recipe), "--run-dir", str(run_dir), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"another run is using this run directory: weft run (pid {os.getpid()})" in done.stderr
    assert not (run_dir / "metrics.jsonl").exists()

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout), "started": "earlier"}))
    done = weft_process("run", str(recipe), "--run-dir", str(run_dir), "--set", "train.max_steps=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "taking over the lock of a run that is gone" in done.stderr
    assert not lock.exists()  # released at the end


def test_sigterm_saves_and_resumes_exactly(weft, recipe, tmp_path):
    """SIGTERM mid-run: the step finishes, a checkpoint is written, exit 0; --resume then
    gives the same losses and gradient norms as a run never interrupted, each step once."""
    steps = "train.max_steps=40"
    keep = "train.checkpoint_every=100"  # the interruption writes the only checkpoint before the end
    reference = tmp_path / "reference"
    done = weft("run", str(recipe), "--run-dir", str(reference), "--set", steps, "--set", keep, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "interrupted"
    process = subprocess.Popen([sys.executable, "-m", "weft", "run", str(recipe), "--run-dir", str(run_dir),
                                "--set", steps, "--set", keep], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["last_step"]
    assert summary["status"] == "interrupted" and summary["reason"] == "SIGTERM" and 3 <= stopped < 40
    assert summary["last_checkpoint"] == f"step-{stopped}"
    assert f"interrupted by SIGTERM after step {stopped}; checkpoint: step-{stopped}" in stderr
    assert not (run_dir / "run.lock").exists()

    done = weft("run", str(recipe), "--run-dir", str(run_dir), "--resume", "--set", steps, "--set", keep,
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = rows(run_dir), rows(reference)
    assert [r["step"] for r in got] == list(range(1, 41))
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-7), a["step"]


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> dict:
    from plugin_site import plugin_env

    return plugin_env(tmp_path_factory.mktemp("plugins"), module="weft_test_plugins", entry="weft-test")


def _with_guards(recipe: pathlib.Path, guards: str) -> pathlib.Path:
    path = recipe.with_name("guarded.toml")
    path.write_text(recipe.read_text() + f"\n[[rules]]\nguard = [{guards}]\n")
    return path


def test_nan_at_step_k(weft, recipe, tmp_path, plugin_site):
    """NaN from step 5: step 5 skipped, step 6 aborts (exit 3, one message); the row of step 6 says so;
    the state before it (step 5 skipped, so after step 4) is saved as step-5; summary says aborted."""
    guarded = _with_guards(recipe, '{ strategy = "finite", max_consecutive_skips = 2 }, '
                                   '{ strategy = "nan_from", step = 5 }')
    run_dir = tmp_path / "run"
    done = weft("run", str(guarded), "--run-dir", str(run_dir), "--set", "train.checkpoint_every=4", cwd=tmp_path,
                env=plugin_site)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.count("weft: error:") == 1 and "Traceback" not in done.stderr
    assert "weft: error: guard: guard 'finite' stopped the run at step 6: grad_norm not finite" in done.stderr
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6] and got[4]["skipped"] and "aborted" in got[5]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["last_checkpoint"] == "step-5"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-4", "step-5"]


def test_raising_plugin_is_named(weft, recipe, tmp_path, plugin_site):
    guarded = _with_guards(recipe, '{ strategy = "raise_at", step = 2 }')
    run_dir = tmp_path / "run"
    done = weft("run", str(guarded), "--run-dir", str(run_dir), cwd=tmp_path, env=plugin_site)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert ("plugin 'weft-test' (weft-test-plugins 0.1) raised RuntimeError in hook weft_guard: "
            "injected failure at step 2") in done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "weft-test" in summary["reason"]
    log = (run_dir / "log.jsonl").read_text()
    assert "run.error" in log and "injected failure at step 2" in log and "weft_test_plugins" in log


def test_peer_that_stops_responding_is_named(recipe, tmp_path, plugin_site):
    """Rank 1 freezes (SIGSTOP) at step 3 while rank 0 waits for it in a collective: after
    parallel.timeout_s rank 0 names rank 1 in one line, ends it, and the run ends (exit 1,
    summary "failed"); nothing hangs."""
    guarded = _with_guards(recipe, '{ strategy = "freeze", step = 3, rank = 1 }')
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "weft", "run", str(guarded), "--run-dir", str(run_dir), "--nproc",
                           "2", "--set", "parallel.timeout_s=4", "--set", "train.checkpoint_every=-1"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=plugin_site)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "rank(s) 1 stopped responding" in done.stderr and "weft: error: parallel.timeout_s: step 3" in done.stderr
    assert "(it waits in " in done.stderr  # the operation rank 0 is stuck in, and weft's caller
    assert done.stderr.count("weft: error:") == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 150
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "rank(s) 1 stopped responding" in summary["reason"]
    assert summary["last_step"] == 2 and [r["step"] for r in rows(run_dir)] == [1, 2]
    # The frozen rank ended by the one that named it (torch's agent would wait 30 s on its SIGTERM).
    ended = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if "run.peers_ended" in line]
    assert [e["ranks"] for e in ended] == [[1]], ended


def test_dead_peer_is_named(recipe, tmp_path, plugin_site):
    """Rank 1 dies (SIGKILL) at step 3: rank 0's collective fails with Gloo's "connection
    reset", which weft turns into one line naming rank 1; summary "failed"."""
    guarded = _with_guards(recipe, '{ strategy = "kill", step = 3, rank = 1 }')
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "weft", "run", str(guarded), "--run-dir", str(run_dir), "--nproc",
                           "2", "--set", "train.checkpoint_every=-1", "--set", "parallel.timeout_s=10"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=plugin_site)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("weft: error:") == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "weft: error: parallel: rank(s) 1 stopped responding; on rank 0 this surfaced as" in done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("parallel: rank(s) 1 stopped responding")


@pytest.mark.quick
def test_plugin_whose_strategies_raise_is_left_out_and_reported(capsys):
    from weft.core.hookspecs import hookimpl
    from weft.core.plan.view import plugins_table
    from weft.core.plugin_manager import build_plugin_manager

    class Broken:
        @hookimpl
        def weft_strategies(self):
            raise ImportError("a missing dependency")

    pm = build_plugin_manager(entry_points=False, extra=[("broken", Broken())])
    table = plugins_table(pm)
    (row,) = [p for p in table["plugins"] if p["name"] == "broken"]
    assert row["error"] == "ImportError: a missing dependency"
    assert any(s["name"] == "ring" for s in table["strategies"])  # the others are all there
    assert "plugin 'broken'" in capsys.readouterr().err



def test_truncated_safetensors_names_the_file(weft, tmp_path):
    """A model directory whose weights file was cut short: one message naming the file, exit 2."""
    from model_helpers import build_model
    from weft.core.recipe import Recipe

    model = build_model(Recipe.from_dict({"model": {"preset": "qwen2_text_tiny"}}))
    model.save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    recipe = tmp_path / "from-dir.toml"
    recipe.write_text(FAST.replace('preset = "qwen2_text_tiny"', f'path = "{tmp_path / "model"}"'))
    done = weft("run", str(recipe), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{weights} is not a readable safetensors file" in done.stderr and "(model.path)" in done.stderr


@pytest.mark.quick
def test_stripped_vision_tokens():
    """A sample whose image tokens were stripped (or whose images were), or whose image span was cut:
    named and skipped before batching; the good ones kept; the image-token share logged."""
    import types

    import structlog

    from weft.plugins.batching.sample_checks import check_vision
    from weft.strategies.data.conversation import Sample

    image, merge = 7, 2
    grid = torch.tensor([[1, 4, 4]])  # 16 patches -> 4 tokens after the 2x2 merge

    def sample(ids, with_image=True):
        ids = torch.tensor(ids)
        return Sample(input_ids=ids, labels=ids.clone(), pixel_values=torch.zeros(16, 8) if with_image else None,
                      image_grid_thw=grid if with_image else None,
                      mm_token_type_ids=(ids == image).long())

    good = sample([1, image, image, image, image, 2])
    stripped = sample([1, 2, 3, 4])  # the image's tokens gone, the image kept
    cut = sample([1, image, image, 2])  # half an image span
    orphan = sample([1, image, image, image, image, 2], with_image=False)  # tokens without their image
    config = types.SimpleNamespace(image_token_id=image, vision_config=types.SimpleNamespace(spatial_merge_size=merge))
    bad, events = [], []
    ctx = types.SimpleNamespace(log=structlog.wrap_logger(
        structlog.ReturnLogger(), processors=[lambda _, __, e: events.append(e) or e]))
    kept = check_vision([good, stripped, cut, orphan, good], config=config, ctx=ctx, on_bad=bad.append)
    assert kept == [good, good]
    assert [b.where for b in bad] == ["sample 1", "sample 2", "sample 3"]
    assert "1 image(s) but no image tokens" in bad[0].reason
    assert "2 image tokens, but its 1 image(s) need 4" in bad[1].reason
    assert "4 image tokens but no image" in bad[2].reason
    assert events[-1]["image_token_ratio"] == round(8 / 12, 4)


def test_out_of_memory_is_one_message_naming_the_levers(weft, recipe, tmp_path, plugin_site):
    """A step that runs out of memory: one paragraph (step, rank, micro-batch sizes, the levers not
    pulled yet with their rule's file:line, the intact checkpoint), exit 1, summary "failed"."""
    guarded = _with_guards(recipe, '{ strategy = "finite" }, { strategy = "oom_at", step = 3 }')
    run_dir = tmp_path / "run"
    done = weft("run", str(guarded), "--run-dir", str(run_dir), cwd=tmp_path, env=plugin_site)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("weft: error:") == 1
    message = done.stderr[done.stderr.index("weft: error:"):]
    assert "out of GPU memory at step 3, rank 0, micro-batches of 64 tokens" in message
    assert 'train.loss = "fused"' in message and "storage_dtype" in message and "micro_batch_tokens (now 64)" in message
    assert "The last checkpoint (step-2) is intact" in message
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "out of GPU memory" in summary["reason"]


def _lock(run_dir: pathlib.Path) -> dict:
    try:
        return json.loads((run_dir / "run.lock").read_text())
    except (OSError, ValueError):
        return {}


def test_ranks_die_with_their_launcher(recipe, tmp_path):
    """SIGKILL of `weft run` (2 ranks, each in a session of its own): a running rank is gone
    within 10 s, its ending recorded; while another rank still lives (frozen here, so that
    "meanwhile" lasts), a second `weft run` into the directory is exit 2 naming that rank's
    pid; once it is let go it is gone within 10 s too, and the directory can be taken."""
    from weft.core.run.lock import process_alive, run_lock

    run_dir = tmp_path / "run"
    log = (tmp_path / "launcher.err").open("w")  # a file, not a pipe: orphaned ranks must never block on it
    launcher = subprocess.Popen([sys.executable, "-m", "weft", "run", str(recipe), "--run-dir", str(run_dir),
                                 "--nproc", "2", "--set", "train.max_steps=100000", "--set",
                                 "train.checkpoint_every=-1"], cwd=tmp_path, stderr=log, stdout=log)
    ranks: dict = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (len(ranks) == 2 and (run_dir / "metrics.jsonl").is_file()):
            ranks = {int(r): e["pid"] for r, e in (_lock(run_dir).get("ranks") or {}).items()}
            assert launcher.poll() is None, (tmp_path / "launcher.err").read_text()[-3000:]
            time.sleep(0.1)
        assert len(ranks) == 2 and _lock(run_dir)["pid"] == launcher.pid, (tmp_path / "launcher.err").read_text()
        for pid in ranks.values():  # torch's agent runs inside `weft run`: the ranks are its own children
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
            assert int(stat[stat.rindex(")") + 2:].split()[1]) == launcher.pid
            assert os.getsid(pid) == pid  # each in a session of its own: no signal to the launcher's group reaches it
        os.kill(ranks[1], signal.SIGSTOP)
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while process_alive(ranks[0]) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert not process_alive(ranks[0]), f"rank 0 outlived its launcher by {time.monotonic() - killed:.1f} s"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and f"launcher (pid {launcher.pid}) is gone" in summary["reason"]
        assert "run.launcher_gone" in (run_dir / "log.jsonl").read_text()

        second = weft_process("run", str(recipe), "--run-dir", str(run_dir), cwd=tmp_path)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"rank 1 (pid {ranks[1]})" in second.stderr and f"(pid {ranks[0]})" not in second.stderr
        assert f"after its weft run (pid {launcher.pid}) ended" in second.stderr

        os.kill(ranks[1], signal.SIGCONT)
        released = time.monotonic()
        while process_alive(ranks[1]) and time.monotonic() - released < 10:
            time.sleep(0.05)
        assert not process_alive(ranks[1]), "rank 1 outlived its launcher"
        with run_lock(run_dir):  # everyone gone: taken over
            assert _lock(run_dir)["pid"] == os.getpid()
    finally:
        for pid in [launcher.pid, *ranks.values()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        log.close()


def test_lock_names_live_ranks_and_refuses_strangers(tmp_path):
    """In-process: a lock whose launcher is gone but whose rank lives refuses the directory
    naming that rank; a rank whose launcher does not hold the lock may not join; a pid
    that now names another process (its start time differs) counts as gone."""
    import socket

    from weft.core.errors import WeftError
    from weft.core.run.lock import LockLost, join_run, process_start, run_lock

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    here = {"host": socket.gethostname(), "started": "earlier"}
    me = {"pid": os.getpid(), "start": process_start(os.getpid())}
    (run_dir / "run.lock").write_text(json.dumps({**here, "pid": dead, "ranks": {"0": me}}))
    with pytest.raises(WeftError, match=rf"rank 0 \(pid {os.getpid()}\) .* after its weft run \(pid {dead}\) ended"):
        with run_lock(run_dir):
            pass
    with pytest.raises(LockLost, match=f"not held by this rank's launcher \\(pid {dead + 1}\\)"):
        join_run(run_dir, launcher_pid=dead + 1, rank=1)
    join_run(run_dir, launcher_pid=dead, rank=1)
    assert _lock(run_dir)["ranks"]["1"] == me
    reused = {"pid": os.getpid(), "start": (me["start"] or 0) + 1}  # same pid, another process
    (run_dir / "run.lock").write_text(json.dumps({**here, "pid": dead, "ranks": {"0": reused}}))
    with run_lock(run_dir):
        assert _lock(run_dir)["pid"] == os.getpid()
    assert not run_dir.exists()  # released, and the empty directory removed


def test_the_launcher_watch_knows_whom_to_watch():
    """In-process, without the thread (it would end pytest): with the launcher as the parent,
    gone means re-parented; with a process between them, the launcher's pid is watched too;
    a launcher gone before the watch began is LauncherGone at once."""
    from weft.core.run.launcher_watch import LauncherGone, LauncherWatch

    parent = LauncherWatch(launcher_pid=os.getppid(), rank=0)
    parent.resolve()
    assert not parent.gone()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        between = LauncherWatch(launcher_pid=other.pid, rank=1)  # alive, but not this process's parent
        between.resolve()
        assert not between.gone()
    finally:
        other.kill()
        other.wait()
    assert between.gone()
    with pytest.raises(LauncherGone, match=f"rank 1: its launcher \\(pid {other.pid}\\) is gone"):
        LauncherWatch(launcher_pid=other.pid, rank=1).resolve()
