"""`weft generate --profile DIR`: where a decoding step's device time goes, kernel by kernel.

The decoding steps (the prefill is not in it) run under torch.profiler; at their end DIR gets
decode_profile.json (the kernels by device time, on a CPU the operators by their own host
time: name, calls, total and per-step microseconds) and decode_profile.txt (torch's own
table). A captured step's replays are
profiled too: CUPTI reports the graph's kernels one by one. The first step (the compilation,
the capture) is in it, as a few kernels more; the per-step figure divides by the steps run
(the caller sets them in the dict it is given: an early stop runs fewer than asked).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator

import torch

#: Kernels kept in the JSON, the costliest first.
ROWS = 40


@contextlib.contextmanager
def decode_profile(folder: pathlib.Path | None, *, steps: int) -> Iterator[dict]:
    """Profile what runs inside (nothing when ``folder`` is None); ``steps``: the decoding steps
    it is to hold, for the per-step figures; the yielded dict's ``steps`` the caller sets to the
    steps it ran."""
    run = {"steps": steps}
    if folder is None:
        yield run
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        yield run
    steps = run["steps"]
    folder.mkdir(parents=True, exist_ok=True)
    on_device = len(activities) > 1  # else (a CPU run) the operators' own host time
    rows = []
    for event in profile.key_averages():
        spent = getattr(event, "self_device_time_total", None) if on_device else event.self_cpu_time_total
        if spent is None:  # an older torch's name for it
            spent = getattr(event, "self_cuda_time_total", 0.0)
        if spent > 0:
            rows.append({"kernel": event.key, "calls": event.count, "total_us": round(spent, 1),
                         "per_step_us": round(spent / max(1, steps), 2)})
    rows.sort(key=lambda r: -r["total_us"])
    total = sum(r["total_us"] for r in rows)
    (folder / "decode_profile.json").write_text(json.dumps(
        {"steps": steps, "device": "cuda" if on_device else "cpu", "total_us": round(total, 1),
         "ms_per_step": round(total / max(1, steps) / 1e3, 3), "kernels": rows[:ROWS]}, indent=1))
    sort = "self_cuda_time_total" if on_device else "self_cpu_time_total"
    (folder / "decode_profile.txt").write_text(profile.key_averages().table(sort_by=sort, row_limit=ROWS))
