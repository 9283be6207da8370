"""Retrieval at 128K tokens on one GPU, learned: a model trained at a short length from random
initialisation, fine-tuned briefly with YaRN at a long one, asked for a passkey and for a digit
image's digit at depths 0-100% of haystacks up to 131,072 tokens.

    python examples/long/retrieval_128k.py OUT --digits examples/digits/data [--length 4096]
        [--factor 32] [--tune-length 65536] [--steps 2000] [--finetune 200] [--train-samples 16000]
        [--eval-lengths 4096,...,131072] [--per-depth 4] [--scalings none,yarn] [--jobs 14]
        [--train-seconds 0] [--data-only]

1. data: examples/long/make_passkey.py's and make_needle.py's training lines of 180 (needles:
   400) to ``--length`` tokens (drawn uniformly in their logarithm: short ones teach where to
   look), their fine-tuning lines of ``--length`` to ``--tune-length``, and their questions at
   each of ``--eval-lengths``, depths 0, 25, 50, 75 and 100%;
2. ``weft run`` of OUT/base.toml (the model of long_vl.toml, both tasks mixed, bf16) for
   ``--steps`` steps, ``weft export``; with ``--train-seconds S``, a 30-step probe's median step
   time first sets the steps to what fits in S seconds (at most ``--steps``; the fine-tune at
   most a tenth of them): a device lent for half an hour takes the experiment in one sitting;
3. ``weft eval --task --forced`` of both tasks at every length, unscaled and under each of
   ``--scalings`` with factor ``--factor`` over the trained length;
4. per scaling, a fine-tune of ``--finetune`` steps (at most a tenth of ``--steps``) on the long
   lines from the export, its evaluations, and the heat maps of both tasks
   (OUT/heatmap-passkey.png, OUT/heatmap-needle.png: ``weft report --heatmap``);
5. OUT/table.md and OUT/summary.json: accuracy by length, before and after, each run's steps,
   tokens/s and wall time.

Every phase that has its output already is skipped: run it again after an interruption.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import statistics
import sys
import time
from collections.abc import Sequence

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_needle  # noqa: E402
import make_passkey  # noqa: E402
from extend import accuracy_by_length, rope, sets, weft  # noqa: E402

TASKS = ("passkey", "needle")
PROBE = 30  # --train-seconds' probe: steps timed before the base run's length is chosen

RECIPE = """\
# Written by examples/long/retrieval_128k.py: {what}
[model]
{model}

[data]
source = "jsonl"
strict = true  # generated: a line weft cannot read is a bug

[[data.sources]]
path = "data/passkey{part}/train.jsonl"

[[data.sources]]
path = "data/needle{part}/train.jsonl"

[train]
max_steps = {steps}
seed = 0
micro_batch_tokens = {tokens}
lr = {lr}
warmup_steps = {warmup}
precision = "bf16"
log_every = 50
checkpoint_every = 0

[parallel]
nproc = 1

[[rules]]
name = "one GPU: plain modules, no recomputation (a 27M-parameter model: its activations fit)"
shard = {{ strategy = "none", checkpoint = "off" }}
batching = {{ strategy = "token_budget", schedule = "global" }}
"""


def make_data(data: pathlib.Path, args) -> None:
    lengths = ",".join(map(str, args.eval_lengths))
    common = ["--jobs", str(args.jobs), "--seed", str(args.seed)]
    if not (data / "passkey" / f"passkey-{args.eval_lengths[-1]}.jsonl").is_file():
        make_passkey.main([str(data / "passkey"), "--train-length", str(args.length),
                           "--train-min-length", str(min(180, args.length)), "--log-lengths",
                           "--train-samples", str(args.train_samples), "--text-fraction", "0.1",
                           "--lengths", lengths, "--per-depth", str(args.per_depth), *common])
    if not (data / "needle" / f"needle-{args.eval_lengths[-1]}.jsonl").is_file():
        make_needle.main([str(data / "needle"), "--digits", str(args.digits), "--train-length", str(args.length),
                          "--train-min-length", str(min(400, args.length)), "--log-lengths",
                          "--train-samples", str(args.train_samples),
                          "--lengths", lengths, "--per-depth", str(args.per_depth), *common])
    # Lines enough for the fine-tune's steps, once: a log-uniform length's mean is (b - a) / ln(b / a).
    mean = (args.tune_length - args.length) / max(math.log(args.tune_length / args.length), 1e-9)
    tune = max(8, math.ceil(args.finetune * max(args.micro_batch_tokens, args.tune_length) / mean / len(TASKS)))
    if not (data / "passkey-long" / "train.jsonl").is_file():
        make_passkey.main([str(data / "passkey-long"), "--train-length", str(args.tune_length), "--train-min-length",
                           str(args.length), "--log-lengths", "--train-samples", str(tune), "--text-fraction", "0.1",
                           "--lengths", "", *common[:2], "--seed", str(args.seed + 1)])
    if not (data / "needle-long" / "train.jsonl").is_file():
        make_needle.main([str(data / "needle-long"), "--digits", str(args.digits), "--train-length",
                          str(args.tune_length), "--train-min-length", str(args.length), "--log-lengths",
                          "--train-samples", str(tune), "--lengths", "", *common[:2], "--seed", str(args.seed + 1)])


def evaluate(recipe: pathlib.Path, run: pathlib.Path, data: pathlib.Path, results: pathlib.Path, *, scaling: str,
             args) -> dict[str, dict[int, float]]:
    found = {}
    for task in TASKS:
        path = results / f"{task}.jsonl"
        if not path.is_file():
            with open(data / task / "tasks.jsonl", "w") as tasks:  # one file: a question's length is in its meta
                for n in args.eval_lengths:
                    tasks.write((data / task / f"{task}-{n}.jsonl").read_text())
            weft("eval", recipe, "--run-dir", run, "--task", data / task / "tasks.jsonl", "--forced", "--results", path,
                 *sets(rope(scaling, factor=args.factor, length=args.length)))
        found[task] = accuracy_by_length(path)
    return found


def fitted_steps(recipe: pathlib.Path, out: pathlib.Path, *, args) -> dict:
    """The base run's steps for ``--train-seconds``, from a probe of PROBE steps (kept in
    OUT/steps.json, so a resumed experiment keeps its choice)."""
    chosen = out / "steps.json"
    if not chosen.is_file():
        probe = out / "probe"
        shutil.rmtree(probe, ignore_errors=True)
        weft("run", recipe, "--run-dir", probe, "--set", f"train.max_steps={PROBE}")
        rows = [json.loads(line) for line in (probe / "metrics.jsonl").read_text().splitlines() if line.strip()]
        step_s = statistics.median(r["step_s"] for r in rows[PROBE // 5:])  # past the first steps' warm-up
        steps = min(args.steps, max(PROBE, int(args.train_seconds / step_s)))
        chosen.write_text(json.dumps({"probe_step_s": round(step_s, 4), "steps": steps}))
        shutil.rmtree(probe, ignore_errors=True)
    return json.loads(chosen.read_text())


def run_summary(run: pathlib.Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    return {k: s.get(k) for k in ("steps", "tokens", "tokens_per_s", "wall_s", "final_loss")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--digits", type=pathlib.Path, required=True,
                        help="examples/digits/make_digits.py's folder (the needles' images and their split)")
    parser.add_argument("--length", type=int, default=4096, help="the trained length")
    parser.add_argument("--factor", type=int, default=32, help="the rotary scaling's factor over --length")
    parser.add_argument("--tune-length", type=int, default=65536, help="the fine-tune's longest line")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--finetune", type=int, default=200)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--micro-batch-tokens", type=int, default=65536)
    parser.add_argument("--train-samples", type=int, default=16000)
    parser.add_argument("--eval-lengths", default="4096,8192,16384,32768,65536,131072")
    parser.add_argument("--per-depth", type=int, default=4)
    parser.add_argument("--scalings", default="none,yarn")
    parser.add_argument("--jobs", type=int, default=14, help="processes writing the data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-only", action="store_true",
                        help="write OUT/data and stop: made on one machine, carried to the GPU's OUT/data")
    parser.add_argument("--train-seconds", type=float, default=0,
                        help="fit the base run's steps to this many seconds from a probe (0: --steps as given)")
    args = parser.parse_args(argv)
    args.eval_lengths = [int(n) for n in args.eval_lengths.split(",")]
    if args.finetune * 10 > args.steps:
        parser.error(f"--finetune {args.finetune}: at most a tenth of --steps {args.steps}")
    out = args.out.resolve()
    args.digits = args.digits.resolve()
    data = out / "data"
    started = time.perf_counter()
    make_data(data, args)
    timings = {"data_s": round(time.perf_counter() - started, 1)}
    if args.data_only:
        print(json.dumps({"data": str(data), **timings}))
        return 0
    shutil.copy(HERE / "long_vl.toml", out / "long_vl.toml")
    base_recipe = out / "base.toml"

    def write_base() -> None:
        base_recipe.write_text(RECIPE.format(
            what=f"the model trained from random initialisation at {args.length} tokens",
            model='preset = "long_vl.toml"', part="", steps=args.steps, tokens=args.micro_batch_tokens, lr=args.lr,
            warmup=50))

    write_base()
    if args.train_seconds > 0:
        fitted = fitted_steps(base_recipe, out, args=args)
        timings["probe_step_s"] = fitted["probe_step_s"]
        args.steps = fitted["steps"]
        args.finetune = min(args.finetune, max(1, args.steps // 10))
        write_base()
    tune_recipe = out / "finetune.toml"
    tune_recipe.write_text(RECIPE.format(
        what=f"the trained model fine-tuned at up to {args.tune_length} tokens",
        model='path = "base-hf"  # the trained model, exported', part="-long", steps=args.finetune,
        tokens=max(args.micro_batch_tokens, args.tune_length), lr=args.lr, warmup=0))
    base = out / "base"
    if not (base / "summary.json").is_file():
        weft("run", base_recipe, "--run-dir", base)
    if not (out / "base-hf").is_dir():
        weft("export", base, out / "base-hf")
    runs = {"base": run_summary(base)}
    table: dict[str, dict[str, dict[str, dict[int, float]]]] = {}
    scalings = args.scalings.split(",")
    for scaling in scalings:
        results = out / "results" / f"base-{scaling}"
        results.mkdir(parents=True, exist_ok=True)
        table[scaling] = {"before": evaluate(base_recipe, base, data, results, scaling=scaling, args=args)}
        if scaling == "none":
            continue  # unscaled, a fine-tune at the long length is a different experiment (position interpolation's)
        tuned = out / f"finetune-{scaling}"
        if not (tuned / "summary.json").is_file():
            weft("run", tune_recipe, "--run-dir", tuned, *sets(rope(scaling, factor=args.factor, length=args.length)))
        runs[f"finetune-{scaling}"] = run_summary(tuned)
        results = out / "results" / f"finetune-{scaling}"
        results.mkdir(parents=True, exist_ok=True)
        table[scaling]["after"] = evaluate(tune_recipe, tuned, data, results, scaling=scaling, args=args)
        for task in TASKS:
            weft("report", "--heatmap", results / f"{task}.jsonl", "--out", out / f"heatmap-{task}-{scaling}.png")
    timings["total_s"] = round(time.perf_counter() - started, 1)
    write_table(out / "table.md", table, args=args)
    summary = {"table": {s: {w: {t: {str(n): v for n, v in a.items()} for t, a in d.items()} for w, d in p.items()}
                         for s, p in table.items()}, "runs": runs, "timings": timings,
               "args": {k: str(v) for k, v in vars(args).items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print((out / "table.md").read_text())
    print(json.dumps({"runs": runs, "timings": timings}))
    return 0


def write_table(path: pathlib.Path, table: dict, *, args) -> None:
    lengths = args.eval_lengths
    lines = ["| task | rotary scaling | | " + " | ".join(f"{n:,}" for n in lengths) + " |",
             "|" + "---|" * (len(lengths) + 3)]
    for task in TASKS:
        for scaling, parts in table.items():
            for when, label in (("before", f"trained at {args.length:,}"),
                                ("after", f"+ {args.finetune} steps to {args.tune_length:,}")):
                if when in parts:
                    cells = " | ".join(f"{parts[when][task].get(n, float('nan')):.0%}" for n in lengths)
                    lines.append(f"| {task} | {scaling} | {label} | {cells} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
