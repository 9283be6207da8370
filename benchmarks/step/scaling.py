"""Sequence parallelism across GPUs against one GPU at the same tokens per GPU (issue 13).

    python3 benchmarks/step/scaling.py --out $OUT                          # every GPU count present, 128K and 256K
    python3 benchmarks/step/scaling.py --out $OUT --gpus 2 --lengths 131072 --strategies ring,ulysses

For each total length L, GPU count N and strategy (ring: ring = N; ulysses: ulysses = N;
usp: ulysses 2 x ring N/2, from 4 GPUs), ``torchrun --nproc-per-node N
benchmarks/step/profile_step.py`` runs the recipe (default: the bundled qwen2.5-7b-128k-2gpu,
Qwen2.5-7B text, FSDP2 over the SP ranks) through weft's own loop, steps 2..k-1 timed
and step k profiled on rank 0; beside it, one GPU runs the same recipe at L/N tokens.
Reported per configuration: tokens/s per GPU and its ratio to the one-GPU rate, MFU per
GPU and its ratio to the one GPU's MFU, peak memory, and the exposed communication (NCCL
kernels with no compute kernel beside them) as a share of the profiled step.

Why both ratios: at the same tokens per GPU the N-GPU run does more work per token. Each
of its tokens attends over the whole length L, the one GPU's over L/N, so at 128K over two
GPUs a token costs ~1.5x the one GPU's at 64K for Qwen2.5-7B (6 N + 6 layers hidden L per
token). The raw tokens/s ratio therefore cannot reach 1 even with free communication; the
MFU ratio (tokens/s per GPU weighted by each run's FLOPs per token) is the parallel
efficiency, and is what issue 13's 90% is read against (docs/sequence-parallel.md).

Writes scaling.json and scaling.md under --out (each run's profile.md in its own folder).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402

from weft.core.plan.flops import PEAK_TFLOPS  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PEAK = PEAK_TFLOPS["H200"] * 1e12  # H100/H200 dense bf16 FLOP/s (core/plan/flops.py)


def model_flops(recipe: str, length: int) -> float:
    """Training FLOPs of one sequence of ``length`` (core/plan/flops.py), the recipe's model on the meta device."""
    import transformers

    from weft.core.plan.flops import sequence_flops, text_parameters
    from weft.core.recipe import Recipe
    from weft.core.recipe.presets import build_config, load_preset

    preset = Recipe.from_toml(recipe).model.preset
    config = build_config(*load_preset(preset)[:2])
    with torch.device("meta"):
        auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") else \
            transformers.AutoModelForCausalLM
        model = auto.from_config(config)
    n, layers, hidden = text_parameters(model)
    return sequence_flops(params=n, layers=layers, hidden=hidden, length=length)


def run(recipe: str, *, gpus: int, ulysses: int, ring: int, length: int, out: pathlib.Path, step: int,
        timeout: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    sets = [f"parallel.ulysses={ulysses}", f"parallel.ring={ring}", f"data.tokens={length}",
            f"train.micro_batch_tokens={length}"]
    launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={gpus}"]
    command = [*launcher, str(HERE / "profile_step.py"), recipe, "--out", str(out), "--step", str(step)]
    for s in sets:
        command += ["--set", s]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not (out / "profile.json").is_file():
        status = "OOM" if "OutOfMemoryError" in done.stderr or "out of GPU memory" in done.stderr else "failed"
        (out / "stderr.txt").write_text(done.stderr[-20000:])
        return {"status": status}
    profile = json.loads((out / "profile.json").read_text())
    steady = [r for r in profile["metrics"] if 2 <= r["step"] < step] or profile["metrics"][1:2]
    step_s = sum(r["step_s"] for r in steady) / len(steady)
    return {"status": "ok", "step_s": step_s, "tokens_per_s_per_gpu": length / step_s / gpus,
            "mfu": model_flops(recipe, length) / step_s / gpus / PEAK,
            "max_memory_gib": max(r.get("max_memory_gib", 0.0) for r in profile["metrics"]),
            "exposed_comm": profile["exposed_comm_ms"] / max(profile["wall_ms"], 1e-9),
            "loss": [r["loss"] for r in profile["metrics"]]}


def layouts(strategy: str, gpus: int) -> tuple[int, int] | None:
    """(ulysses, ring) for a strategy over ``gpus``; None when it does not apply."""
    if strategy == "ring":
        return 1, gpus
    if strategy == "ulysses":
        return gpus, 1
    if strategy == "usp" and gpus >= 4 and gpus % 2 == 0:
        return 2, gpus // 2
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--recipe", default="qwen2.5-7b-128k-2gpu")
    parser.add_argument("--gpus", default="", help="GPU counts, e.g. 2,4 (default: 2, 4, 8 up to those present)")
    parser.add_argument("--lengths", default="131072,262144")
    parser.add_argument("--strategies", default="ring,ulysses,usp")
    parser.add_argument("--step", type=int, default=4, help="the profiled step; steps 2..step-1 are timed")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    args = parser.parse_args()
    present = torch.cuda.device_count()
    counts = [int(g) for g in args.gpus.split(",")] if args.gpus else [g for g in (2, 4, 8) if g <= present]
    table = []
    for length in (int(x) for x in args.lengths.split(",")):
        for gpus in counts:
            single = run(args.recipe, gpus=1, ulysses=1, ring=1, length=length // gpus,
                         out=args.out / f"1gpu-{length // gpus}", step=args.step, timeout=args.timeout)
            for strategy in args.strategies.split(","):
                layout = layouts(strategy, gpus)
                if layout is None:
                    continue
                row = run(args.recipe, gpus=gpus, ulysses=layout[0], ring=layout[1], length=length,
                          out=args.out / f"{strategy}{gpus}-{length}", step=args.step, timeout=args.timeout)
                if row["status"] == "ok" and single["status"] == "ok":
                    row["vs_one_gpu"] = row["tokens_per_s_per_gpu"] / single["tokens_per_s_per_gpu"]
                    row["efficiency"] = row["mfu"] / single["mfu"]
                table.append({"length": length, "gpus": gpus, "strategy": strategy, "ulysses": layout[0],
                              "ring": layout[1], "run": row, "one_gpu": single})
                print(json.dumps(table[-1]), flush=True)
    write(table, args.out, recipe=args.recipe)


def write(table: list[dict], out: pathlib.Path, *, recipe: str) -> None:
    (out / "scaling.json").write_text(json.dumps(table, indent=1))
    lines = [f"Recipe `{recipe}`; one GPU at the same tokens per GPU beside each row.", "",
             "| tokens | GPUs | strategy | tok/s per GPU | vs one GPU | MFU | vs one GPU's MFU | peak GiB | "
             "exposed comm | one GPU tok/s | one GPU MFU |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in table:
        r, one = t["run"], t["one_gpu"]
        base = (f"{one['tokens_per_s_per_gpu']:,.0f} | {100 * one['mfu']:.1f}%" if one["status"] == "ok"
                else f"{one['status']} |")
        if r["status"] != "ok":
            lines.append(f"| {t['length']:,} | {t['gpus']} | {t['strategy']} | {r['status']} | | | | | | {base} |")
            continue
        ratio = f"{r['vs_one_gpu']:.3f}" if "vs_one_gpu" in r else "-"
        efficiency = f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
        lines.append(f"| {t['length']:,} | {t['gpus']} | {t['strategy']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{ratio} | {100 * r['mfu']:.1f}% | {efficiency} | {r['max_memory_gib']:.1f} | "
                     f"{100 * r['exposed_comm']:.1f}% | {base} |")
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
