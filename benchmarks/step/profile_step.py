"""Where one training step's GPU time goes: weft's own loop, one step under torch.profiler.

    python3 benchmarks/step/profile_step.py --out $OUT qwen2.5-vl-7b-32k-1gpu --set data.tokens=32768
    python3 benchmarks/step/profile_step.py --out $OUT benchmarks/step/variants/7b-mlp28-logits.toml --step 3
    torchrun --nproc-per-node 2 benchmarks/step/profile_step.py --out $OUT qwen2.5-7b-128k-2gpu   # rank 0 writes

The recipe runs through weft's loop (the run's plugin manager plus one in-process guard
plugin that starts the profiler at the chosen step's ``step_start`` and stops it at the
next step's), so the step profiled is the one users run. Writes under --out:
``profile.md`` (time per kernel family, the GPU's busy fraction over the step, its idle
gaps and the host operations behind them, the exposed communication: NCCL kernels with no
compute kernel beside them, the 40 longest kernels) and ``profile.json`` (the same,
machine-readable). weft is imported from the checkout (benchmarks/_bootstrap.py).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402
from _one_step import arguments, run_watched, title  # noqa: E402

ensure_weft()

import torch  # noqa: E402

from weft.core.hookspecs import hookimpl  # noqa: E402

# First match wins: kernel-name fragments -> family. Names differ by library and GPU;
# "other" collects the rest (profile.md lists the longest kernels by name).
FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "FlashAttn")),
    ("nccl", ("nccl",)),
    ("optimizer", ("multi_tensor_apply",)),
    ("compiled (triton)", ("triton_",)),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm100_", "cublas")),
    ("copy", ("memcpy", "Memcpy", "copy", "Copy", "CatArrayBatched", "split_with_sizes", "chunk_cat")),
    ("element-wise / reduce", ("elementwise", "vectorized", "reduce_kernel", "unrolled", "index", "scatter",
                               "softmax", "norm", "cross_entropy", "nll", "log_softmax")),
)


def family(name: str) -> str:
    for label, fragments in FAMILIES:
        if any(f in name for f in fragments):
            return label
    return "other"


class StepProfiler:
    """A guard that profiles one step (forward, backward, grad sync and optimizer)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.profiler: torch.profiler.profile | None = None

    @hookimpl
    def weft_guard(self, event, state, plan, ctx):
        if event == "step_start" and state.step == self.step:
            _sync()
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
        elif event == "step_start" and state.step == self.step + 1 and self.profiler is not None:
            _sync()
            self.profiler.__exit__(None, None, None)
        return None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
#: The step's phases as weft's loop marks them on the host (core/train/timing.py: ``weft.forward``, ...).
PHASES = ("forward", "backward", "optimizer")
#: Kernel-name fragments of an attention forward (flash-attn-4's, cuDNN's "fprop"): in the
#: backward phase, the attention's recomputation.
FORWARD_ATTENTION = ("fwd", "Fwd", "fprop", "forward", "Forward")


def summarise(trace: dict) -> dict:
    """Kernel time by family, the GPU's busy time, and the idle gaps with what the host
    was doing, from the profiler's Chrome trace (its kernels carry the correlation id of
    the host call that launched them)."""
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES),
                     key=lambda e: e["ts"])
    if not kernels:
        return {"wall_ms": 0.0, "busy_ms": 0.0, "kernel_ms": 0.0, "kernels": 0, "exposed_comm_ms": 0.0,
                "families_ms": {},
                "idle_gaps": {"total_ms": 0.0, "count": 0, "by_host_op_ms": {}, "longest": []}, "top": []}
    spans = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])  # the GPU's busy time
    busy, end_seen = sum(b - a for a, b in spans), spans[-1][1]
    wall = end_seen - kernels[0]["ts"]
    # Communication no compute kernel runs beside: the step's exposed communication.
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if family(e["name"]) == "nccl"])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if family(e["name"]) != "nccl"])
    exposed = sum(b - a for a, b in comm) - _overlap(comm, compute)
    by_family: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        by_family[family(e["name"])] = by_family.get(family(e["name"]), 0.0) + e["dur"]
        entry = by_name.setdefault(e["name"], [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]
    return {"wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "kernel_ms": sum(by_family.values()) / 1e3,
            "kernels": len(kernels), "exposed_comm_ms": exposed / 1e3,
            "families_ms": {k: v / 1e3 for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            **by_phase(kernels, events),
            "idle_gaps": _gaps(kernels, events),
            "top": [{"name": n[:160], "ms": t / 1e3, "calls": c, "family": family(n)} for n, (t, c) in top]}


def _launches(events: list) -> dict:
    """The host's launch events by correlation id (a kernel's ``args.correlation``)."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def by_phase(kernels: list, events: list) -> dict:
    """Kernel milliseconds by the step's phase (the ``weft.<phase>`` host range its launch fell
    in, on any thread: autograd launches the backward's kernels from its own) and family, and
    the recomputation's share, estimated: in the backward, the attention's forward kernels, and
    the matrix products beyond twice the forward's (a backward's products are twice its
    forward's FLOPs: input and weight gradients, one each per forward product)."""
    windows = sorted((e["ts"], e["ts"] + e["dur"], e["name"][len("weft."):]) for e in events
                     if e.get("ph") == "X" and e.get("name", "").startswith("weft.")
                     and e["name"][len("weft."):] in PHASES)
    launches = _launches(events)
    phases: dict[str, dict[str, float]] = {}
    attention_again = 0.0
    for e in kernels:
        launch = launches.get(e.get("args", {}).get("correlation"))
        at = launch["ts"] if launch else e["ts"]
        phase = next((name for start, end, name in windows if start <= at <= end), "outside the phases")
        fam = family(e["name"])
        part = phases.setdefault(phase, {})
        part[fam] = part.get(fam, 0.0) + e["dur"] / 1e3
        if phase == "backward" and fam == "attention" and any(f in e["name"] for f in FORWARD_ATTENTION):
            attention_again += e["dur"] / 1e3
    forward, backward = phases.get("forward", {}), phases.get("backward", {})
    products_again = max(0.0, backward.get("matmul", 0.0) - 2 * forward.get("matmul", 0.0))
    return {"phases_ms": phases, "recompute_ms": {"attention forward in the backward": attention_again,
                                                  "matrix products beyond 2x the forward's": products_again}}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        total += max(0.0, min(first[i][1], second[j][1]) - max(first[i][0], second[j][0]))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total


def _gaps(kernels: list, events: list, *, least_us: float = 20.0) -> dict:
    """Stretches of >= ``least_us`` with no kernel running: their total, grouped by the
    host operations that launched the kernel ending each gap, and the longest ones."""
    launches = _launches(events)
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES),
                  key=lambda e: e["ts"])
    origin = kernels[0]["ts"]
    found, end_seen, before = [], None, None
    for e in kernels:
        if end_seen is not None and e["ts"] - end_seen >= least_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            stack = _stack_at(host, launch) if launch else []
            found.append({"at_ms": (end_seen - origin) / 1e3, "ms": (e["ts"] - end_seen) / 1e3,
                          "launched_late_ms": ((launch["ts"] - end_seen) / 1e3) if launch else None,
                          "before": before[:80], "after": e["name"][:80], "host": stack})
        if end_seen is None or e["ts"] + e["dur"] > end_seen:
            end_seen, before = e["ts"] + e["dur"], e["name"]
    by_op: dict[str, float] = {}
    for gap in found:
        key = " > ".join(gap["host"][:2]) or "?"
        by_op[key] = by_op.get(key, 0.0) + gap["ms"]
    return {"total_ms": sum(g["ms"] for g in found), "count": len(found),
            "by_host_op_ms": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:25]),
            "longest": sorted(found, key=lambda g: -g["ms"])[:30]}


def _stack_at(host: list, launch: dict) -> list[str]:
    """Names of the host operations on the launching thread enclosing the launch, outermost
    first (the step's own annotations and the aten ops)."""
    ts, tid = launch["ts"], launch.get("tid")
    return [e["name"][:70] for e in host
            if e.get("tid") == tid and e["ts"] <= ts <= e["ts"] + e.get("dur", 0)][:8]


def write(summary: dict, out: pathlib.Path, title: str) -> None:
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# {title}", "",
             f"step wall (first to last kernel) {summary['wall_ms']:,.0f} ms; GPU busy {summary['busy_ms']:,.0f} ms "
             f"({100 * summary['busy_ms'] / max(summary['wall_ms'], 1e-9):.1f}%); {summary['kernels']:,} kernels "
             f"summing {summary['kernel_ms']:,.0f} ms (streams overlap); exposed communication (NCCL with no "
             f"compute beside it) {summary['exposed_comm_ms']:,.0f} ms", "",
             "| family | ms | share of kernel time |", "| --- | ---: | ---: |"]
    for name, ms in summary["families_ms"].items():
        lines.append(f"| {name} | {ms:,.1f} | {100 * ms / summary['kernel_ms']:.1f}% |")
    phases = summary.get("phases_ms", {})
    if phases:
        families = list(summary["families_ms"])
        lines += ["", "| phase (host range of the launch) | ms | " + " | ".join(families) + " |",
                  "| --- | ---: | " + " | ".join("---:" for _ in families) + " |"]
        for phase, parts in phases.items():
            lines.append(f"| {phase} | {sum(parts.values()):,.1f} | "
                         + " | ".join(f"{parts.get(f, 0.0):,.1f}" for f in families) + " |")
        again = summary["recompute_ms"]
        lines += ["", "recomputation, estimated: " + "; ".join(f"{k} {v:,.1f} ms" for k, v in again.items())
                  + f" (together {sum(again.values()):,.1f} ms)"]
    gaps = summary["idle_gaps"]
    lines += ["", f"GPU idle in gaps of 20 us or more: {gaps['total_ms']:,.0f} ms in {gaps['count']} gaps", "",
              "| host operations launching the kernel after the gap (outermost two) | idle ms |", "| --- | ---: |"]
    lines += [f"| {op} | {ms:,.1f} |" for op, ms in gaps["by_host_op_ms"].items()]
    lines += ["", "| at ms | gap ms | launched ms after gap start | kernel after | host stack at its launch |",
              "| ---: | ---: | ---: | --- | --- |"]
    for g in gaps["longest"]:
        late = "?" if g["launched_late_ms"] is None else f"{g['launched_late_ms']:.1f}"
        lines.append(f"| {g['at_ms']:,.1f} | {g['ms']:.1f} | {late} | `{g['after']}` | {' > '.join(g['host'])} |")
    lines += ["", "| kernel | family | calls | ms |", "| --- | --- | ---: | ---: |"]
    for row in summary["top"]:
        lines.append(f"| `{row['name']}` | {row['family']} | {row['calls']} | {row['ms']:,.1f} |")
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    args = arguments(__doc__.splitlines()[0], step=3, extra=[("--trace", {
        "action": "store_true", "help": "also write trace.json.gz (Chrome/Perfetto trace)"})])
    profiler = StepProfiler(args.step)
    rows = run_watched(args, name="step-profiler", plugin=profiler)
    if rows is None:
        return
    trace_path = args.out / "trace.json"
    profiler.profiler.export_chrome_trace(str(trace_path))
    summary = summarise(json.loads(trace_path.read_text()))
    if args.trace:
        with trace_path.open("rb") as raw, gzip.open(args.out / "trace.json.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
    trace_path.unlink()
    summary["metrics"] = rows
    write(summary, args.out, title(args))


if __name__ == "__main__":
    main()
