"""`weft report RUN_DIR [RUN_DIR ...] [--out FILE.png|FILE.html]`: a run's curves and summary.

From what every run writes (metrics.jsonl, summary.json, log.jsonl, recipe.json): loss,
tokens/s, MFU (GPU runs of a known GPU: the model's FLOPs per token from its config on
the meta device), peak memory, gradient norm and learning rate against step; skipped
steps and checkpoints marked; a preference objective's rewards, margin and preference accuracy;
several runs overlaid under their folder names. A step that a restart ran again (resume from
an earlier checkpoint) counts once, its last run.
Made with matplotlib (the ecosystem's default; `pip install 'weft[report]'`), headless.
``--heatmap RESULTS.jsonl``: a task's accuracy by depth x length instead (core/commands/heatmap.py).
"""

from __future__ import annotations

import base64
import html
import io
import json
import pathlib
import statistics
import sys
from typing import Any

from weft.core.errors import EXIT_OK, WeftError
from weft.core.plan.flops import frozen_text_parameters, peak_tflops, sequence_flops, text_parameters

PANELS = (("loss", "loss"), ("eval_accuracy", "held-out accuracy (eval.task; band: 95% interval)"),
          ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("max_memory_gib", "peak memory (GiB)"),
          ("grad_norm", "grad norm"), ("lr", "learning rate"),
          # A preference objective's (plugins/objective.py, each the mean over the step's pairs):
          ("reward_chosen", "rewards: chosen (solid), rejected (dashed)"),
          ("reward_margin", "reward margin (chosen - rejected)"),
          ("preference_accuracy", "preference accuracy (chosen reward the higher)"))


def read_run(run_dir: pathlib.Path) -> dict[str, Any]:
    """One run's rows (one per step, the last run of a repeated step wins), summary,
    checkpoints and where it ran."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise WeftError(f"{run_dir} has no metrics.jsonl; weft report takes weft run directories",
                        where=str(run_dir))
    by_step: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    rows = [by_step[s] for s in sorted(by_step)]
    summary = _json(run_dir / "summary.json") or {"status": "no summary (still running, or killed)"}
    events = [_event(line) for line in _lines(run_dir / "log.jsonl")]
    start = next((e for e in events if e.get("event") == "run.start"), {})
    checkpoints = sorted({e["step"] for e in events if e.get("event") == "checkpoint.saved" and "step" in e})
    run = {"name": run_dir.name, "dir": str(run_dir), "rows": rows, "summary": summary, "checkpoints": checkpoints,
           "world_size": start.get("world_size", 1), "gpu": start.get("gpu")}
    peak = peak_tflops(run["gpu"])
    flops = _flops_per_token(run_dir) if peak else None
    for row in rows:
        if flops and row.get("tokens_per_s"):
            row["mfu"] = flops * row["tokens_per_s"] / (peak * 1e12 * run["world_size"])
    return run


def summary_lines(runs: list[dict]) -> list[str]:
    """One line per run: final loss, median tokens/s, peak memory, status."""
    lines = []
    for run in runs:
        rows, summary = run["rows"], run["summary"]
        speed = statistics.median([r["tokens_per_s"] for r in rows[1:] or rows if "tokens_per_s" in r] or [0])
        memory = max((r.get("max_memory_gib", 0.0) for r in rows), default=0.0)
        mfu = [r["mfu"] for r in rows[1:] if "mfu" in r]
        skipped = sum(1 for r in rows if r.get("skipped"))
        held = [r for r in rows if r.get("eval_loss") is not None]
        lines.append(
            f"{run['name']}: {summary.get('status', '?')}"
            + (f" ({summary['reason']})" if summary.get("reason") else "")
            + f"; {len(rows)} steps (last {rows[-1]['step'] if rows else '-'})"
            + (f", final loss {rows[-1]['loss']:.4f}" if rows and rows[-1].get("loss") is not None else "")
            + (f", held-out loss {held[-1]['eval_loss']:.4f} at step {held[-1]['step']}" if held else "")
            + (f", held-out preference accuracy {held[-1]['eval_preference_accuracy']:.1%}"
               if held and "eval_preference_accuracy" in held[-1] else "")
            + (f", held-out accuracy {held[-1]['eval_accuracy']:.4f} ({held[-1]['eval_accuracy_low']:.4f}-"
               f"{held[-1]['eval_accuracy_high']:.4f})" if held and "eval_accuracy" in held[-1] else "")
            + (f", reward margin {rows[-1]['reward_margin']:.4f}, preference accuracy "
               f"{rows[-1]['preference_accuracy']:.1%}" if rows and "reward_margin" in rows[-1] else "")
            + f", median {speed:,.0f} tokens/s"
            + (f", MFU {statistics.median(mfu):.1%}" if mfu else "")
            + (f", peak {memory:.1f} GiB" if memory else "")
            + f", {skipped} skipped steps, checkpoints at {run['checkpoints'] or 'none'}")
    return lines


def plot(runs: list[dict], out: pathlib.Path) -> pathlib.Path:
    """The figure as a PNG, or an HTML page holding it and the summary."""
    try:
        import matplotlib
    except ImportError:
        raise WeftError("weft report draws with matplotlib, which is not installed: pip install 'weft[report]'",
                        where="weft report") from None
    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [(key, label) for key, label in PANELS if any(key in r for run in runs for r in run["rows"])]
    cols = 2
    fig, axes = plt.subplots((len(panels) + 1) // cols, cols, figsize=(12, 3.2 * ((len(panels) + 1) // cols)),
                             squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        for run in runs:
            points = [(r["step"], r[key]) for r in run["rows"] if r.get(key) is not None]
            if not points:
                continue
            line, = ax.plot(*zip(*points), label=run["name"], linewidth=1.4)
            skipped = [(r["step"], r[key]) for r in run["rows"] if r.get("skipped") and r.get(key) is not None]
            if skipped:
                ax.scatter(*zip(*skipped), marker="x", color="red", zorder=3)
            held_out = [(r["step"], r["eval_loss"]) for r in run["rows"] if r.get("eval_loss") is not None]
            rejected = [(r["step"], r["reward_rejected"]) for r in run["rows"] if r.get("reward_rejected") is not None]
            if key == "reward_chosen" and rejected:  # the rejected responses' beside the chosen ones', dashed
                ax.plot(*zip(*rejected), color=line.get_color(), linestyle="--", linewidth=1.4)
            if key == "loss" and held_out:  # [eval]'s held-out loss beside the training loss, dashed
                ax.plot(*zip(*held_out), color=line.get_color(), linestyle="--", marker="o", markersize=3,
                        label=f"{run['name']} (held out)")
            band = [(r["step"], r["eval_accuracy_low"], r["eval_accuracy_high"]) for r in run["rows"]
                    if key == "eval_accuracy" and r.get("eval_accuracy_low") is not None]
            if band:  # the accuracy's Wilson interval: how far apart two runs must be to differ
                ax.fill_between(*zip(*band), color=line.get_color(), alpha=0.15)
            for step in run["checkpoints"]:
                ax.axvline(step, color=line.get_color(), alpha=0.25, linestyle=":")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("weft report: " + ", ".join(run["name"] for run in runs) + "  (x: skipped step, dotted: checkpoint)")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".html":
        image = base64.b64encode(buffer.getvalue()).decode()
        items = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(runs))
        out.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>weft report</title></head><body>"
                       f"<h1>weft report</h1><ul>{items}</ul><img src='data:image/png;base64,{image}' "
                       f"alt='weft report'></body></html>\n")
    else:
        out.write_bytes(buffer.getvalue())
    return out


def _flops_per_token(run_dir: pathlib.Path) -> float | None:
    """Training FLOPs per token (core/plan/flops.py) of the run's recipe, planned on the meta device
    (its adapters added, its frozen units and an adapter's base counted at 4 FLOPs, not 6); L the
    samples' length: data.tokens, else train.seq_len, an upper bound for chat data. None if the
    model cannot be built."""
    try:
        from weft.core.commands.export import run_recipe
        from weft.core.plan.planner import plan_recipe
        from weft.core.plugin_manager import plugin_manager_from_env

        recipe, pm = run_recipe(run_dir), plugin_manager_from_env()
        try:
            plan, model = plan_recipe(recipe, pm=pm, world_size=recipe.parallel.nproc)
            for path in plan.frozen_units():
                model.get_submodule(path).requires_grad_(False)
        except Exception:  # noqa: BLE001 - a mesh for another world size: the model alone, all trained
            model = pm.models.for_recipe(recipe).build(recipe, device="meta", seed=0)
    except Exception:  # noqa: BLE001 - MFU is a courtesy: without the model the report still stands
        return None
    n, layers, hidden = text_parameters(model)
    length = recipe.data.tokens or recipe.train.seq_len
    return sequence_flops(params=n, frozen=frozen_text_parameters(model), layers=layers, hidden=hidden,
                          length=length) / length


def _json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _lines(path: pathlib.Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _event(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def cmd_report(args) -> int:
    if args.heatmap:
        return _heatmap(args)
    if not args.run_dirs:
        raise WeftError("weft report takes run directories (or --heatmap RESULTS.jsonl)", where="weft report")
    out = args.out or args.run_dirs[0] / "report.png"
    if out.suffix.lower() not in (".png", ".html"):
        raise WeftError(f"--out {out}: the report is written as .png or .html", where="--out")
    runs = [read_run(run_dir) for run_dir in args.run_dirs]
    for line in summary_lines(runs):
        print(line)
    print(f"weft report: {plot(runs, out)}", file=sys.stderr)
    return EXIT_OK


def _heatmap(args) -> int:
    """`--heatmap FILE [...]`: a task's accuracy by depth x length (core/commands/heatmap.py)."""
    from weft.core.commands.heatmap import draw_heatmaps, heatmap_lines

    if args.run_dirs:
        raise WeftError("weft report draws run directories or --heatmap results files, not both in one figure",
                        where="--heatmap")
    out = args.out or args.heatmap[0].with_suffix(".png")
    if out.suffix.lower() != ".png":
        raise WeftError(f"--out {out}: the heat map is written as .png", where="--out")
    for line in heatmap_lines(args.heatmap):
        print(line)
    print(f"weft report: {draw_heatmaps(args.heatmap, out)}", file=sys.stderr)
    return EXIT_OK
