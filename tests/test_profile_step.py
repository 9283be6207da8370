"""benchmarks/step/profile_step.py's arithmetic on a made-up trace, and the phase ranges weft's
loop leaves in a profile (core/train/timing.py): kernels told apart by the phase their launch
fell in, the backward's from autograd's own thread too, and the recomputation estimated."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from weft.core.train.timing import PhaseTimer

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "benchmarks" / "step" / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel(name, ts, dur, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _launch(ts, correlation, tid):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": correlation}}


def test_kernels_by_phase_and_the_recomputation():
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "weft.forward", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "weft.backward", "ts": 100, "dur": 300, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "weft.optimizer", "ts": 400, "dur": 50, "tid": 1},
        _launch(10, 1, 1), _kernel("nvjet_gemm_bf16", 12, 40, 1),
        _launch(20, 2, 1), _kernel("flash_fwd_kernel", 60, 20, 2),
        _launch(110, 3, 2), _kernel("nvjet_gemm_bf16", 120, 100, 3),  # autograd's thread (tid 2)
        _launch(115, 4, 2), _kernel("flash_fwd_kernel", 220, 20, 4),  # the attention again: recomputed
        _launch(120, 5, 2), _kernel("flash_bwd_kernel", 240, 50, 5),
        _launch(410, 6, 1), _kernel("multi_tensor_apply_kernel", 410, 30, 6),
        _kernel("memcpy", 500, 5, 7),  # no launch seen: by its own time, outside every phase
    ]
    script = _script()
    kernels = sorted((e for e in events if e["cat"] == "kernel"), key=lambda e: e["ts"])
    split = script.by_phase(kernels, events)
    assert split["phases_ms"] == {
        "forward": {"matmul": 0.04, "attention": 0.02},
        "backward": {"matmul": 0.1, "attention": 0.07},
        "optimizer": {"optimizer": 0.03},
        "outside the phases": {"copy": 0.005},
    }
    again = split["recompute_ms"]
    assert again["attention forward in the backward"] == pytest.approx(0.02)
    assert again["matrix products beyond 2x the forward's"] == pytest.approx(0.1 - 2 * 0.04)


def test_the_report_has_the_phase_table(tmp_path):
    script = _script()
    events = [{"ph": "X", "cat": "user_annotation", "name": "weft.forward", "ts": 0, "dur": 100, "tid": 1},
              _launch(1, 1, 1), _kernel("nvjet_gemm_bf16", 2, 500, 1)]
    summary = script.summarise({"traceEvents": events})
    script.write(summary, tmp_path, "made up")
    text = (tmp_path / "profile.md").read_text()
    assert "| phase (host range of the launch) | ms | matmul |" in text and "| forward | 0.5 | 0.5 |" in text
    assert "recomputation, estimated" in text


def test_the_loop_marks_its_phases_for_the_profiler():
    timer = PhaseTimer(torch.device("cpu"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        timer.start("forward")
        torch.ones(4).sum()
        timer.stop("forward")
        timer.start("backward")
        timer.start("backward")  # left open by a phase that raised: closed, not nested
        timer.stop("backward")
    names = [e.key for e in profile.key_averages()]
    assert "weft.forward" in names and "weft.backward" in names
    counts = {e.key: e.count for e in profile.key_averages()}
    assert counts["weft.backward"] == 2 and set(timer.seconds()) == {"forward_s", "backward_s"}
