"""Where one training step's peak GPU memory goes: weft's own loop, one step under the allocator's history.

    python3 benchmarks/memory/memory_peak.py --out $OUT qwen2.5-vl-7b-lora-128k-1gpu --step 2
    python3 benchmarks/memory/memory_peak.py --out $OUT qwen2.5-vl-7b-128k-1gpu --step 2   # the same without adapters

The recipe runs through weft's loop (as benchmarks/step/profile_step.py: an in-process guard plugin
starts torch's CUDA memory history at the chosen step's ``step_start`` and takes the snapshot at
the next one's), so the step measured is the one users run. The allocator's trace is replayed
(an ``alloc`` adds its bytes, a ``free_completed`` takes them back) from what was allocated when
the step began, to find the step's peak and what was live at it. Writes under --out
``memory_peak.md`` and ``memory_peak.json``: the peak (and torch's own ``max_memory_allocated``
beside it), the bytes allocated before the step (weights, gradients, states: one row), the
allocation that reached the peak with its stack, and the step's allocations live at the peak
grouped by where they were made (the innermost frame of weft, transformers, PEFT, torchao or
flash-attn, else torch's; and the innermost weft frame), largest first. The snapshot itself (hundreds of MB) is
not kept unless ``--pickle``. Made for the planner's unexplained rows (docs/estimate.md: the
LoRA surplus, float8's recomputation at 128K): what a GPU holds that a CPU run does not show.
"""

from __future__ import annotations

import collections
import json
import pathlib
import pickle
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402
from _one_step import arguments, run_watched, title  # noqa: E402

ensure_weft()

import torch  # noqa: E402

from weft.core.hookspecs import hookimpl  # noqa: E402

GIB = 2**30
#: Where a frame counts as the code that made an allocation: the innermost frame of these
#: packages names it; failing that, the innermost of torch's own (autograd, checkpoint, nn).
OWNERS = ("/weft/", "/transformers/", "/peft/", "/torchao/", "/flash_attn/")
FALLBACK = ("/torch/",)


class StepMemory:
    """A guard that records one step's allocations (forward, backward, grad sync and optimizer)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before = 0
        self.snapshot: dict | None = None
        self.max_allocated = 0

    @hookimpl
    def weft_guard(self, event, state, plan, ctx):
        if event == "step_start" and state.step == self.step:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            # Python stacks at allocation only: the cheapest history that still says who allocated.
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=4_000_000)
        elif event == "step_start" and state.step == self.step + 1 and self.snapshot is None:
            torch.cuda.synchronize()
            self.max_allocated = torch.cuda.max_memory_allocated()
            self.snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        return None


def peak_of(events: list[dict], *, before: int) -> tuple[int, int | None, dict[int, dict]]:
    """(peak bytes, the index of the event that reached it, the allocations of the trace live at
    it by address): ``events`` replayed from ``before`` bytes (what was allocated when the trace
    began: those allocations have no events)."""
    live: dict[int, dict] = {}
    now = peak = before
    at, kept = None, {}
    for index, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at, kept = now, index, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
        elif action == "free_completed":  # made before the trace began: it leaves the "before" bytes
            now -= event["size"]
    return peak, at, kept


def owner(frames: list[dict], *, only: tuple[str, ...] = OWNERS) -> str:
    """The innermost frame of ``only``'s packages (then of torch's) as ``path:line name``, the path
    from the package folder on; or the innermost frame at all (torch's frames come innermost first)."""
    for marks in (only, FALLBACK):
        for frame in frames:
            name = frame.get("filename", "")
            for mark in marks:
                if mark in name:
                    return f"{name[name.index(mark) + 1:]}:{frame.get('line', 0)} {frame.get('name', '')}"
    if not frames:
        return "(no stack)"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line', 0)} {frames[0].get('name', '')}"


def grouped(live: dict[int, dict], *, key) -> list[dict]:
    """The live allocations by ``key(frames)``: bytes and count, largest first."""
    sizes, counts = collections.Counter(), collections.Counter()
    for event in live.values():
        label = key(event.get("frames", []))
        sizes[label] += event["size"]
        counts[label] += 1
    return [{"where": label, "gib": round(size / GIB, 3), "count": counts[label]}
            for label, size in sizes.most_common()]


def summarise(snapshot: dict, *, before: int, max_allocated: int, device: int = 0) -> dict:
    events = snapshot["device_traces"][device]
    peak, at, live = peak_of(events, before=before)
    stack = [f"{f.get('filename', '?')}:{f.get('line', 0)} {f.get('name', '')}"
             for f in (events[at].get("frames", []) if at is not None else [])][:16]
    return {"peak_gib": round(peak / GIB, 3), "max_memory_allocated_gib": round(max_allocated / GIB, 3),
            "before_step_gib": round(before / GIB, 3), "events": len(events),
            "step_live_at_peak_gib": round(sum(e["size"] for e in live.values()) / GIB, 3),
            "reached_by": {"gib": round(events[at]["size"] / GIB, 3), "stack": stack} if at is not None else None,
            "by_owner": grouped(live, key=owner)[:40],
            "by_weft_frame": grouped(live, key=lambda frames: owner(frames, only=("/weft/",)))[:25]}


def write(summary: dict, out: pathlib.Path, title: str) -> None:
    (out / "memory_peak.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# {title}", "",
             f"peak (the trace replayed) {summary['peak_gib']} GiB; torch's max_memory_allocated "
             f"{summary['max_memory_allocated_gib']} GiB; allocated before the step {summary['before_step_gib']} GiB; "
             f"the step's allocations live at the peak {summary['step_live_at_peak_gib']} GiB "
             f"({summary['events']:,} events)", ""]
    if summary["reached_by"]:
        lines += [f"the allocation that reached the peak: {summary['reached_by']['gib']} GiB, made at", "",
                  *[f"    {frame}" for frame in summary["reached_by"]["stack"]], ""]
    for name, rows in (("where made (the innermost frame of weft, transformers, PEFT, torchao, flash-attn)",
                        summary["by_owner"]), ("the innermost weft frame", summary["by_weft_frame"])):
        lines += [f"## live at the peak, by {name}", "", "| where | GiB | allocations |", "|---|---:|---:|",
                  *[f"| `{r['where']}` | {r['gib']} | {r['count']} |" for r in rows], ""]
    if summary.get("metrics"):
        lines += ["## the run's steps", "", *[f"    {json.dumps(row)}" for row in summary["metrics"]], ""]
    (out / "memory_peak.md").write_text("\n".join(lines))


def main() -> None:
    args = arguments(__doc__.splitlines()[0], step=2, extra=[("--pickle", {
        "action": "store_true", "help": "also keep snapshot.pickle (torch's memory_viz reads it)"})])
    recorder = StepMemory(args.step)
    rows = run_watched(args, name="step-memory", plugin=recorder)
    if rows is None or recorder.snapshot is None:
        return
    if args.pickle:
        with (args.out / "snapshot.pickle").open("wb") as handle:
            pickle.dump(recorder.snapshot, handle)
    summary = summarise(recorder.snapshot, before=recorder.before, max_allocated=recorder.max_allocated,
                        device=torch.cuda.current_device())
    summary["metrics"] = rows
    write(summary, args.out, title(args))


if __name__ == "__main__":
    main()
