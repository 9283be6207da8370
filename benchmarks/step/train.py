"""weft against plain transformers, one training run each, in ONE run on one GPU.

    python3 benchmarks/step/train.py --out $OUT                       # 7B at 32K, 64K, 128K; 3B at 128K
    python3 benchmarks/step/train.py --out $OUT --only 7b:32768 --steps 4

weft: `weft run` of the bundled recipe (qwen2.5-vl-7b-128k-1gpu / qwen2.5-vl-3b-128k-1gpu)
with `data.tokens` and `train.micro_batch_tokens` set to the length, so the real loop,
rules and plugins run; its metrics rows give the step time, its split (forward,
backward, optimizer: CUDA events) and the peak memory. Plain transformers: the method of
the project's baseline (shared/bench/hf_baseline.py): the same model class and shapes,
bf16 weights and AdamW states, SDPA, gradient checkpointing, one 448x448 image and
random ids filling the length, `model(..., labels=...)` computing the logits and the loss.
Each side runs in its own process (a fresh CUDA context and allocator). Steady state:
the mean of steps 2..n. MFU = (6·N·L + 6·layers·hidden·L²) / step / 989 TFLOP/s, N the text
parameters without embeddings, lm_head included. Writes train.json, train.md and
train.png (tokens/s and peak memory against length) under --out.

weft is imported from the checkout (benchmarks/_bootstrap.py); structlog must be
importable (carry its wheel to the GPU machine, device/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402

import weft  # noqa: E402
from weft.core.plan.flops import PEAK_TFLOPS, sequence_flops, text_parameters  # noqa: E402
from weft.core.recipe.presets import build_config, load_preset  # noqa: E402

RECIPES = {"7b": "qwen2.5-vl-7b-128k-1gpu", "3b": "qwen2.5-vl-3b-128k-1gpu"}
PRESETS = {"7b": "qwen2_5_vl_7b", "3b": "qwen2_5_vl_3b"}
DEFAULT = ("7b:32768", "7b:65536", "7b:131072", "3b:131072")
PEAK = PEAK_TFLOPS["H200"] * 1e12  # H100/H200 dense bf16 FLOP/s (core/plan/flops.py)


def text_params(size: str) -> tuple[float, int, int]:
    """(N, layers, hidden) of the text model as core/plan/flops.py counts them, on the meta device."""
    import transformers

    config = build_config(*load_preset(PRESETS[size])[:2])
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    n, layers, hidden = text_parameters(model)
    return float(n), layers, hidden


def mfu(size: str, length: int, step_s: float) -> float:
    n, layers, hidden = text_params(size)
    return sequence_flops(params=n, layers=layers, hidden=hidden, length=length) / step_s / PEAK


# ---------------------------------------------------------------------------
# plain transformers (the baseline's method), in a child process
# ---------------------------------------------------------------------------


def hf_child(size: str, length: int, steps: int) -> dict:
    import transformers

    config = build_config(*load_preset(PRESETS[size])[:2])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    grid = torch.tensor([[1, 448 // 14, 448 // 14]], device="cuda")  # one 448x448 image
    patches = int(grid.prod())
    image_tokens = patches // 4
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)  # (N_patches, D)
    ids = torch.randint(0, 150000, (1, length), device="cuda")  # (B, S)
    ids[0, 10] = config.vision_start_token_id
    ids[0, 11:11 + image_tokens] = config.image_token_id
    ids[0, 11 + image_tokens] = config.vision_end_token_id
    rows = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids, pixel_values=pixels, image_grid_thw=grid)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out.loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        rows.append({"step_s": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                     "loss": float(out.loss)})
        del out
    return {"rows": rows, "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def run_hf(size: str, length: int, steps: int, timeout: int) -> dict:
    code = [sys.executable, __file__, "--hf-child", f"{size}:{length}", "--steps", str(steps)]
    done = subprocess.run(code, capture_output=True, text=True, timeout=timeout)
    if "OutOfMemoryError" in done.stderr:
        return {"status": "OOM"}
    if done.returncode != 0:
        return {"status": "failed", "stderr": done.stderr[-2000:]}
    return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


# ---------------------------------------------------------------------------
# weft, through `weft run`
# ---------------------------------------------------------------------------


def run_weft(size: str, length: int, steps: int, timeout: int, scratch: pathlib.Path, recipe: str | None = None
             ) -> dict:
    run_dir = scratch / f"weft-{size}-{length}"
    checkout = pathlib.Path(weft.__file__).parent.parent  # the folder that makes `import weft` work (not resolved)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "weft", "run", recipe or RECIPES[size], "--run-dir", str(run_dir),
               "--set", f"data.tokens={length}", "--set", f"train.micro_batch_tokens={length}",
               "--set", f"train.max_steps={steps}", "--set", "train.checkpoint_every=-1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=scratch)
    if "OutOfMemoryError" in done.stderr:
        return {"status": "OOM"}
    metrics = run_dir / "metrics.jsonl"
    if done.returncode != 0 or not metrics.is_file():
        return {"status": "failed", "stderr": done.stderr[-2000:]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"status": "ok", "rows": rows, "max_memory_gib": max(r.get("max_memory_gib", 0.0) for r in rows)}


def steady(result: dict, size: str, length: int) -> dict:
    """Means over steps 2..n of what both sides report, plus tokens/s and MFU."""
    if result["status"] != "ok":
        return {"status": result["status"]}
    rows = result["rows"][1:] or result["rows"]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in ("step_s", "forward_s", "backward_s", "optimizer_s")}
    return {"status": "ok", **mean, "tokens_per_s": length / mean["step_s"], "mfu": mfu(size, length, mean["step_s"]),
            "max_memory_gib": result["max_memory_gib"], "loss_first": result["rows"][0]["loss"],
            "loss_last": result["rows"][-1]["loss"]}


def cell(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    return (f"{row['tokens_per_s']:,.0f} tok/s, MFU {100 * row['mfu']:.1f}%, {row['max_memory_gib']:.1f} GiB; "
            f"fwd/bwd/opt {row['forward_s']:.2f}/{row['backward_s']:.2f}/{row['optimizer_s']:.2f} s")


def plot(table: list[dict], path: pathlib.Path, *, device: str = "", memory_gib: float = 0.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for size in sorted({r["size"] for r in table}):
        for side, marker in (("weft", "o"), ("transformers", "s")):
            points = [(r["length"], r[side]) for r in table if r["size"] == size and r[side]["status"] == "ok"]
            if not points:
                continue
            lengths = [p[0] for p in points]
            speed.plot(lengths, [p[1]["tokens_per_s"] for p in points], marker=marker, label=f"{size} {side}")
            memory.plot(lengths, [p[1]["max_memory_gib"] for p in points], marker=marker, label=f"{size} {side}")
    for axis, label in ((speed, "tokens/s"), (memory, "peak GPU memory (GiB)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens per step")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    if torch.cuda.is_available():
        device, memory_gib = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 2**30
    if memory_gib:
        memory.axhline(memory_gib, color="grey", linestyle="--")
    figure.suptitle(f"Qwen2.5-VL, one {device or 'GPU'}: weft vs plain transformers")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--only", default=",".join(DEFAULT), help="size:length pairs, e.g. 7b:32768,3b:131072")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per side and length")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-weft", action="store_true", help="plain transformers only (e.g. while another call "
                        "of the same lease runs weft; --replot joins the two)")
    parser.add_argument("--recipe", help="weft's recipe (name or path) instead of the bundled one, e.g. a lever "
                        "variant from benchmarks/step/variants/")
    parser.add_argument("--hf-child", help=argparse.SUPPRESS)
    parser.add_argument("--replot", help="train.json files of earlier runs (comma-separated): one table and plot "
                        "from all their rows, nothing run")
    parser.add_argument("--device", default="NVIDIA H200", help="with --replot: the GPU named in the plot")
    parser.add_argument("--memory-gib", type=float, default=139.8, help="with --replot: the GPU's memory line")
    args = parser.parse_args()
    if args.hf_child:
        size, length = args.hf_child.split(":")
        print(json.dumps(hf_child(size, int(length), args.steps)))
        return
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        table = joined([row for f in args.replot.split(",") for row in json.loads(pathlib.Path(f).read_text())])
        write(table, args.out, device=args.device, memory_gib=args.memory_gib)
        return
    table = []
    for pair in args.only.split(","):
        size, length = pair.split(":")
        length = int(length)
        recipe = str(pathlib.Path(args.recipe).resolve()) if args.recipe and pathlib.Path(args.recipe).exists() \
            else args.recipe
        weft_row = {"status": "skipped"} if args.skip_weft else steady(
            run_weft(size, length, args.steps, args.timeout, args.out, recipe), size, length)
        hf_row = {"status": "skipped"} if args.skip_hf else steady(run_hf(size, length, args.steps, args.timeout),
                                                                   size, length)
        table.append({"size": size, "length": length, "weft": weft_row, "transformers": hf_row})
        print(json.dumps(table[-1]), flush=True)
    write(table, args.out)


def joined(rows: list[dict]) -> list[dict]:
    """Rows of the same model and length merged: each side from the row that ran it."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        into = merged.setdefault((row["size"], row["length"]), dict(row))
        for side in ("weft", "transformers"):
            if row[side]["status"] != "skipped":
                into[side] = row[side]
    return list(merged.values())


def write(table: list[dict], out: pathlib.Path, **plot_kw) -> None:
    """train.json, train.md and train.png under ``out``."""
    (out / "train.json").write_text(json.dumps(table, indent=1))
    lines = ["| model | tokens | weft | plain transformers | weft / transformers |", "|---|---:|---|---|---:|"]
    for r in table:
        ratio = (f"{r['weft']['tokens_per_s'] / r['transformers']['tokens_per_s']:.2f}x"
                 if r["weft"]["status"] == r["transformers"]["status"] == "ok" else "-")
        lines.append(f"| {r['size']} | {r['length']:,} | {cell(r['weft'])} | {cell(r['transformers'])} | {ratio} |")
    (out / "train.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(table, out / "train.png", **plot_kw)


if __name__ == "__main__":
    main()
