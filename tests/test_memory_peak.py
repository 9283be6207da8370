"""benchmarks/memory/memory_peak.py's reading of the allocator's trace (the GPU row's arithmetic, on a
trace made by hand): the peak replayed from the bytes allocated before the step, what is live at
it, grouped by the innermost frame of the packages that made it."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.quick

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30


def _module():
    spec = importlib.util.spec_from_file_location("memory_peak", ROOT / "benchmarks" / "memory" / "memory_peak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


def test_the_peak_and_what_is_live_at_it():
    peak = _module()
    lora = _frames(("/x/torch/nn/functional.py", 10, "linear"), ("/x/site-packages/peft/tuners/lora/layer.py", 7,
                                                                     "forward"),
                   ("/x/weft/core/train/step.py", 99, "run_micro_batches"))
    mlp = _frames(("/x/site-packages/transformers/models/qwen2/modeling_qwen2.py", 5, "forward"),
                  ("/x/weft/core/train/step.py", 99, "run_micro_batches"))
    events = [
        {"action": "alloc", "addr": 1, "size": 2 * GIB, "frames": lora},
        {"action": "alloc", "addr": 2, "size": 3 * GIB, "frames": mlp},
        {"action": "free_requested", "addr": 1, "size": 2 * GIB, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 2 * GIB, "frames": []},
        {"action": "alloc", "addr": 3, "size": 1 * GIB, "frames": lora},
        {"action": "free_completed", "addr": 99, "size": 4 * GIB, "frames": []},  # allocated before the step
        {"action": "alloc", "addr": 4, "size": 3 * GIB, "frames": []},
    ]
    top, at, live = peak.peak_of(events, before=10 * GIB)
    assert (top, at) == (15 * GIB, 1) and set(live) == {1, 2}  # 10 + 2 + 3; later 14, then 10 + 3 + 1 - 4 + 3
    summary = peak.summarise({"device_traces": [events]}, before=10 * GIB, max_allocated=15 * GIB)
    assert summary["peak_gib"] == 15 and summary["step_live_at_peak_gib"] == 5
    assert summary["reached_by"]["gib"] == 3 and "modeling_qwen2.py:5" in summary["reached_by"]["stack"][0]
    assert [(r["where"], r["gib"]) for r in summary["by_owner"]] == [
        ("transformers/models/qwen2/modeling_qwen2.py:5 forward", 3), ("peft/tuners/lora/layer.py:7 forward", 2)]
    assert summary["by_weft_frame"] == [{"where": "weft/core/train/step.py:99 run_micro_batches", "gib": 5,
                                         "count": 2}]
