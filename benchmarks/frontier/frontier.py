"""The longest sequence that trains, measured beside the planner's prediction.

    python3 benchmarks/frontier/frontier.py --out $OUT --recipe qwen2.5-vl-7b-512k-1gpu --lengths 131072,262144,524288
    python3 benchmarks/frontier/frontier.py --out $OUT --recipe qwen2.5-vl-7b-768k-2gpu --gpus 2 --lengths 786432
    python3 benchmarks/frontier/frontier.py --out $OUT --recipe qwen2.5-vl-7b-512k-1gpu --search --budget-s 560

For each length: one training step through `weft run` of the recipe with `data.tokens` and
`train.micro_batch_tokens` set to it (forward, backward, optimizer; ``--steps`` more for a
steady figure where time allows), its step time, tokens/s, MFU, peak GPU memory (the
metrics' ``max_memory_gib``) and peak host memory (the run's largest resident set, pinned
buffers included), and beside it `weft plan --estimate`'s prediction for the same recipe
and length. ``--search`` then tries lengths downward from the planner's longest that fits,
an eighth less each time, until one trains or the time budget is spent. A GPU command is
stopped after 10 minutes: at 512K a step takes ~8, so one length per call. Writes
frontier.json, frontier.md and frontier.png (memory and tokens/s against length, the
predictions dashed) under --out; rows from earlier calls are kept (``--out`` accumulates).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import weft  # noqa: E402


def predict(recipe: str, length: int, gpus: int) -> dict:
    """The planner's estimate for the recipe at ``length`` (in this process: meta device only)."""
    from weft.core.plan.estimate_view import estimate
    from weft.core.plan.planner import plan_recipe
    from weft.core.plugin_manager import plugin_manager_from_env
    from weft.core.recipe import Recipe

    loaded = Recipe.from_toml(recipe, overrides=(f"data.tokens={length}", f"train.micro_batch_tokens={length}"))
    plan, model = plan_recipe(loaded, pm=plugin_manager_from_env(), world_size=gpus)
    return estimate(loaded, plan, model, gpu="h200")


def measure(recipe: str, length: int, gpus: int, steps: int, timeout: int, scratch: pathlib.Path) -> dict:
    run_dir = scratch / f"run-{length}"
    checkout = pathlib.Path(weft.__file__).parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "weft", "run", recipe, "--run-dir", str(run_dir), "--nproc", str(gpus),
               "--set", f"data.tokens={length}", "--set", f"train.micro_batch_tokens={length}",
               "--set", f"train.max_steps={steps}", "--set", "train.checkpoint_every=-1"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.monotonic()
    log = scratch / f"log-{length}.txt"  # written as the run goes: a run cut by the timeout still tells how far
    try:
        with log.open("w") as sink:
            done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, env=env,
                                  cwd=scratch)
    except subprocess.TimeoutExpired:
        done = None  # the step may have finished and only the exit been cut: its metrics tell
    host_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far
    metrics = run_dir / "metrics.jsonl"
    if done is None and not (metrics.is_file() and metrics.read_text().strip()):
        return {"status": "timeout", "wall_s": time.monotonic() - start}
    if done is not None and (done.returncode != 0 or not metrics.is_file()):
        text = log.read_text(errors="replace")
        oom = "out of GPU memory" in text or "OutOfMemoryError" in text
        return {"status": "OOM" if oom else "failed", "wall_s": time.monotonic() - start}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = rows[1:] or rows  # the first step compiles
    step_s = sum(r["step_s"] for r in timed) / len(timed)
    host = [r["host_max_gib"] for r in rows if "host_max_gib" in r]  # the run's own (rank 0's) resident set
    return {"status": "ok", "step_s": step_s, "first_step_s": rows[0]["step_s"], "steps": len(rows),
            "tokens_per_s_per_gpu": length / step_s / gpus,
            "max_memory_gib": max(r.get("max_memory_gib", 0.0) for r in rows),
            "host_peak_gib": max(host) if host else host_kib / 2**20 if host_kib > before else None,
            "loss": [r["loss"] for r in rows], "wall_s": time.monotonic() - start}


def row(recipe: str, length: int, gpus: int, steps: int, timeout: int, scratch: pathlib.Path) -> dict:
    guess = predict(recipe, length, gpus)
    got = measure(recipe, length, gpus, steps, timeout, scratch)
    # One step measured: its peak is a first step's (AdamW makes its states at the step's end).
    first = got["status"] == "ok" and got["steps"] == 1
    predicted = {"gpu_gib": guess["memory_gib"]["first step" if first else "total"],
                 "gpu_gib_steady": guess["memory_gib"]["total"], "first_step": first,
                 "host_gib": guess["host_gib"] * guess["ranks_per_host"],
                 "step_s": guess["step_s"]["total"], "mfu": guess["mfu"], "fits": guess["fits"],
                 "longest_tokens": guess["longest_tokens"]}
    out = {"length": length, "gpus": gpus, "recipe": recipe, "measured": got, "predicted": predicted}
    if got["status"] == "ok":
        out["measured"]["mfu"] = guess["mfu"] * guess["step_s"]["total"] / got["step_s"]  # same FLOPs, measured time
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--recipe", default="qwen2.5-vl-7b-512k-1gpu")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--lengths", default="", help="comma-separated token counts, each measured")
    parser.add_argument("--steps", type=int, default=1, help="steps per run (more: a steady figure past compile)")
    parser.add_argument("--search", action="store_true", help="then downward from the planner's longest length")
    parser.add_argument("--budget-s", type=float, default=560.0, help="stop starting runs after this many seconds")
    parser.add_argument("--timeout", type=int, default=590, help="seconds per run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table_path = args.out / "frontier.json"
    table = json.loads(table_path.read_text()) if table_path.is_file() else []
    start = time.monotonic()
    for length in (int(x) for x in args.lengths.split(",") if x):
        table.append(row(args.recipe, length, args.gpus, args.steps, args.timeout, args.out))
    if args.search:
        multiple = 1024 * args.gpus
        length = predict(args.recipe, multiple, args.gpus)["longest_tokens"] or multiple
        while time.monotonic() - start < args.budget_s:
            table.append(row(args.recipe, length, args.gpus, 1, int(args.budget_s - (time.monotonic() - start)) + 30,
                             args.out))
            if table[-1]["measured"]["status"] == "ok":
                break
            length = max(multiple, (length * 7 // 8) // multiple * multiple)
    table_path.write_text(json.dumps(table, indent=1))
    write(table, args.out)


def write(table: list[dict], out: pathlib.Path) -> None:
    lines = ["| GPUs | tokens | status | step s (predicted) | tokens/s per GPU | MFU | peak GPU GiB (predicted) | "
             "peak host GiB (predicted) |", "|---:|---:|---|---|---:|---:|---|---|"]
    for r in sorted(table, key=lambda r: (r["gpus"], r["length"])):
        m, p = r["measured"], r["predicted"]
        if m["status"] == "ok":
            host = f"{m['host_peak_gib']:.1f}" if m.get("host_peak_gib") else "?"
            lines.append(f"| {r['gpus']} | {r['length']:,} | ok | {m['step_s']:.1f} ({p['step_s']:.1f}) | "
                         f"{m['tokens_per_s_per_gpu']:,.0f} | {100 * m['mfu']:.1f}% | {m['max_memory_gib']:.1f} "
                         f"({p['gpu_gib']:.1f}) | {host} ({p['host_gib']:.1f}) |")
        else:
            lines.append(f"| {r['gpus']} | {r['length']:,} | {m['status']} | - ({p['step_s']:.1f}) | - | - | - "
                         f"({p['gpu_gib']:.1f}) | - ({p['host_gib']:.1f}) |")
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(table, out / "frontier.png")


def plot(table: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for gpus in sorted({r["gpus"] for r in table}):
        rows = sorted((r for r in table if r["gpus"] == gpus), key=lambda r: r["length"])
        ok = [r for r in rows if r["measured"]["status"] == "ok"]
        lengths = [r["length"] for r in rows]
        memory.plot(lengths, [r["predicted"].get("gpu_gib_steady", r["predicted"]["gpu_gib"]) for r in rows], "--",
                    label=f"{gpus} GPU predicted")
        steady = [r for r in ok if not r["predicted"].get("first_step")]
        first = [r for r in ok if r["predicted"].get("first_step")]
        memory.plot([r["length"] for r in steady], [r["measured"]["max_memory_gib"] for r in steady], "o-",
                    label=f"{gpus} GPU measured")
        if first:  # one step measured: AdamW's states not yet made during its backward
            memory.plot([r["length"] for r in first], [r["measured"]["max_memory_gib"] for r in first], "s",
                        fillstyle="none", label=f"{gpus} GPU, a first step")
            memory.plot([r["length"] for r in first], [r["predicted"]["gpu_gib"] for r in first], "x",
                        label=f"{gpus} GPU, a first step predicted")
        speed.plot(lengths, [r["length"] / r["predicted"]["step_s"] / gpus for r in rows], "--",
                   label=f"{gpus} GPU predicted")
        speed.plot([r["length"] for r in ok], [r["measured"]["tokens_per_s_per_gpu"] for r in ok], "o-",
                   label=f"{gpus} GPU measured")
    for axis, label in ((memory, "peak GPU memory per rank (GiB)"), (speed, "tokens/s per GPU")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens per step")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle("Qwen2.5-VL-7B: the longest sequence that trains, and the planner's prediction")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
