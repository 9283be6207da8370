"""Retrieval at 128K tokens on one GPU, learned: a model trained at a short length from random
initialisation, fine-tuned briefly with YaRN at a long one, asked for a passkey and for a digit
image's digit at depths 0-100% of haystacks up to 131,072 tokens.

    python examples/long/retrieval_128k.py OUT --digits examples/digits/data [--model passkey_vl.toml]
        [--warm-length 512] [--warm-steps 6000] [--warm-samples 12000,8000] [--digits-samples 21570]
        [--rope-theta 1000000] [--distractors 0] [--length 16384] [--steps 4000] [--factor 8] [--tune-length 131072]
        [--finetune 300] [--lr 5e-4] [--finetune-lr 2e-4] [--finetune-warmup 30] [--long-share 0.5]
        [--edge-depths 0.2] [--passes 4] [--eval-lengths 4096,...,131072] [--per-depth 4]
        [--scalings none,yarn] [--jobs 14] [--data-only] [--until warm|base]

1. data: examples/long/make_passkey.py's and make_needle.py's training lines of each stage
   (drawn uniformly in the logarithm of their length: short ones teach where to look; the base
   stage's and the fine-tune's ``--long-share`` uniform in the top half instead; ``--edge-depths``
   of the keys and needles at depth 0 or 1 exactly, where two of the five question depths sit), the
   fine-tune's lines of ``--length`` to ``--tune-length``, and the questions at each of
   ``--eval-lengths``, depths 0, 25, 50, 75 and 100% (needles: the one digit image of the
   haystack, ``--distractors`` named others beside it). Only the warm stage's lines are
   written before training starts; the rest are written by a second process (``--data-only``)
   while the warm stage trains;
2. the warm stage, from random initialisation: ``--warm-steps`` steps of 4,096 tokens on lines of
   180 (needles: 300) to ``--warm-length`` tokens and examples/digits' own questions, fp32,
   lr 1e-3 — the recipe that leaves the plateau where a key's digits sit at chance
   (BENCHMARKS.md, "Retrieval to 128K, second attempt: the warm stage, on CPU"). An exported
   model already at OUT/warm-hf (trained elsewhere, carried) takes its place;
3. the base stage, from the warm stage's export, unscaled: ``--steps`` steps on lines up to the
   trained length ``--length``, bf16; ``weft export``;
4. ``weft eval --task --forced`` of both tasks at every length, unscaled and under each of
   ``--scalings`` with factor ``--factor`` over the trained length;
5. per scaling, a fine-tune of ``--finetune`` steps (at most a tenth of the two stages' steps)
   at ``--finetune-lr`` (2e-4, 30 warmup steps) on the long lines from the export, its
   evaluations, and the heat maps of both tasks (OUT/heatmap-passkey-S.png,
   OUT/heatmap-needle-S.png: ``weft report --heatmap``);
6. OUT/table.md and OUT/summary.json: accuracy by length, before and after, each run's steps,
   tokens/s and wall time.

Every phase that has its output already is skipped and a run cut off resumes from its newest
checkpoint: run it again after an interruption, or in a second device call on the same machine
(benchmarks/run_rows.sh retrieval).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_needle  # noqa: E402
import make_passkey  # noqa: E402
from extend import accuracy_by_length, rope, sets, weft  # noqa: E402

TASKS = ("passkey", "needle")
LOWEST = {"passkey": 180, "needle": 300}  # a stage's shortest line: a needle line holds three images and their names

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
{extra}
[train]
max_steps = {steps}
seed = 0
micro_batch_tokens = {tokens}
lr = {lr}
warmup_steps = {warmup}
precision = "{precision}"
log_every = 50
checkpoint_every = {checkpoint}  # a device call cut off resumes from the newest

[parallel]
nproc = 1

[[rules]]
name = "one GPU: plain modules, no recomputation (a small model: its activations fit)"
shard = {{ strategy = "none", checkpoint = "off" }}
batching = {{ strategy = "token_budget", schedule = "global" }}
"""


# The warm stage's third source: examples/digits' own questions ("Which digit is this?", one image,
# 72 tokens), repeated. A needle line gives one digit to learn from in ~450 tokens; without
# these the warm stage answered every needle with the same digit at step 2,000 (CPU).
DIGITS = """
[[data.sources]]
path = {path}
samples = {samples}  # the 1,438 training images, repeated: ~10 digit questions a step
"""


def preset_text(source: pathlib.Path, *, theta: float | None) -> str:
    """The model preset's text, its rotary base set to ``theta`` where given (the one
    ``rope_theta = ...`` line replaced: the preset stays the one place for the rest of the model)."""
    text = source.read_text()
    if theta is None:
        return text
    text, found = re.subn(r"^rope_theta = (\S+)", rf"rope_theta = {theta:.1f}  # --rope-theta (the preset's: \1)",
                          text, flags=re.MULTILINE)
    if found != 1:
        raise SystemExit(f"--rope-theta {theta:g}: {source} has {found} lines 'rope_theta = ...', not one")
    return text


def lines_for(steps: int, *, tokens: int, low: int, high: int, long_share: float = 0.0, passes: float = 4) -> int:
    """Training lines for ``steps`` steps of ``tokens`` tokens, per task, each seen about ``passes``
    times (fewer lines cost less time to write and encode; a line seen again shows the same key
    in the same haystack, yet four times as many lines, each seen once, retrieved no better at CPU
    scale: BENCHMARKS.md, "The far keys at CPU scale"): a log-uniform length's mean is
    (b - a) / ln(b / a), the ``long_share`` drawn from the top half's 3/4 b."""
    mean = (high - low) / max(math.log(high / low), 1e-9) if high > low else high
    mean = (1 - long_share) * mean + long_share * 0.75 * high
    return max(8, math.ceil(steps * max(tokens, high) / mean / len(TASKS) / passes))


def make_train(data: pathlib.Path, part: str, *, low: int, high: int, samples: dict[str, int], seed: int,
               args, long_share: float = 0.0) -> None:
    """One stage's training lines, ``samples[task]`` of each task, lengths ``low`` (at least the
    task's LOWEST) to ``high``, ``long_share`` of them in the top half; ``--edge-depths`` of the
    needles at depth 0 or 1."""
    for task, maker in (("passkey", make_passkey), ("needle", make_needle)):
        folder = data / f"{task}{part}"
        if (folder / "train.jsonl").is_file():
            continue
        own = (["--text-fraction", "0.1"] if task == "passkey" else
               ["--digits", str(args.digits), "--distractors", str(args.distractors)])
        maker.main([str(folder), "--train-min-length", str(max(low, LOWEST[task])), *own, "--jobs", str(args.jobs),
                    "--seed", str(seed), "--lengths", "", "--log-lengths", "--train-length", str(high),
                    "--train-samples", str(samples[task]), "--long-share", str(long_share),
                    "--edge-depths", str(args.edge_depths)])


def make_warm(data: pathlib.Path, args) -> None:
    """The warm stage's lines: ``--warm-samples`` passkey and needle lines to ``--warm-length``."""
    counts = dict(zip(TASKS, (int(n) for n in args.warm_samples.split(","))))
    make_train(data, "-warm", low=0, high=args.warm_length, samples=counts, seed=args.seed, args=args)


def make_data(data: pathlib.Path, args) -> None:
    """Everything but the warm stage's lines: the base stage's, the fine-tune's, the questions."""
    lengths = ",".join(map(str, args.eval_lengths))
    common = ["--jobs", str(args.jobs), "--seed", str(args.seed), "--lengths", lengths, "--per-depth",
              str(args.per_depth), "--train-samples", "0"]
    if not (data / "passkey-eval" / f"passkey-{args.eval_lengths[-1]}.jsonl").is_file():
        make_passkey.main([str(data / "passkey-eval"), *common])
    if not (data / "needle-eval" / f"needle-{args.eval_lengths[-1]}.jsonl").is_file():
        make_needle.main([str(data / "needle-eval"), "--digits", str(args.digits), "--distractors",
                          str(args.distractors), *common])
    share = args.long_share
    base = lines_for(args.steps, tokens=args.micro_batch_tokens, low=LOWEST["passkey"], high=args.length,
                     long_share=share, passes=args.passes)
    make_train(data, "", low=0, high=args.length, seed=args.seed, args=args, samples=dict.fromkeys(TASKS, base),
               long_share=share)
    tune = lines_for(args.finetune, tokens=args.tune_length, low=args.length, high=args.tune_length, long_share=share,
                     passes=args.passes)
    make_train(data, "-long", low=args.length, high=args.tune_length, seed=args.seed + 1, args=args,
               samples=dict.fromkeys(TASKS, tune), long_share=share)


def evaluate(recipe: pathlib.Path, run: pathlib.Path, data: pathlib.Path, results: pathlib.Path, *, scaling: str,
             args) -> dict[str, dict[int, float]]:
    found = {}
    for task in TASKS:
        path = results / f"{task}.jsonl"
        questions = data / f"{task}-eval"
        if not path.is_file():
            with open(questions / "tasks.jsonl", "w") as tasks:  # one file: a question's length is in its meta
                for n in args.eval_lengths:
                    tasks.write((questions / f"{task}-{n}.jsonl").read_text())
            weft("eval", recipe, "--run-dir", run, "--task", questions / "tasks.jsonl", "--forced", "--results", path,
                 *sets(rope(scaling, factor=args.factor, length=args.length)))
        found[task] = accuracy_by_length(path)
    return found


def run_summary(run: pathlib.Path) -> dict:
    s = json.loads((run / "summary.json").read_text())
    return {k: s.get(k) for k in ("steps", "tokens", "tokens_per_s", "wall_s", "final_loss")}


def trained(recipe: pathlib.Path, run: pathlib.Path, export: pathlib.Path | None, *keys: str) -> dict:
    """``weft run`` (skipped when the run has ended before; resumed from its newest checkpoint
    when it was cut off after one), ``weft export`` of it where named."""
    if export is not None and export.is_dir() and not (run / "summary.json").is_file():
        return {}  # the model came exported (a stage trained elsewhere, carried): nothing to run
    if not (run / "summary.json").is_file():
        resume = any((run / "checkpoints").glob("step-*"))
        if not resume:
            shutil.rmtree(run, ignore_errors=True)
        weft("run", recipe, "--run-dir", run, *(["--resume"] if resume else []), *keys)
    if export is not None and not export.is_dir():
        weft("export", run, export)
    return run_summary(run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--digits", type=pathlib.Path, required=True,
                        help="examples/digits/make_digits.py's folder (the needles' images and their split)")
    parser.add_argument("--model", type=pathlib.Path, default=HERE / "passkey_vl.toml",
                        help="the model preset trained from random initialisation")
    parser.add_argument("--rope-theta", type=float, default=1e6,
                        help="the model's rotary base (Qwen2.5's 1,000,000; 0: the preset's own). With the preset's "
                             "10,000 and 32-wide heads the slowest frequency turns 2.9 rad over 16,384 tokens, so a "
                             "key the trained length away scores against the question as if turned round: that "
                             "base model found keys only within ~4K tokens of the question")
    parser.add_argument("--warm-length", type=int, default=512, help="the warm stage's longest line")
    parser.add_argument("--warm-steps", type=int, default=6000)
    parser.add_argument("--warm-samples", default="12000,8000", help="the warm stage's passkey and needle lines")
    parser.add_argument("--digits-samples", type=int, default=21570,
                        help="the warm stage's digit questions (examples/digits' training split, repeated)")
    parser.add_argument("--distractors", type=int, default=0,
                        help="other named digit images in each needle line (training and questions); with 2 the "
                             "CPU warm stage picked the right one of three at chance after 3,000 steps, 40%% at 5,000")
    parser.add_argument("--long-share", type=float, default=0.5,
                        help="the base stage's and the fine-tune's share of lines in the top half of their lengths "
                             "(the rest log-uniform)")
    parser.add_argument("--edge-depths", type=float, default=0.2,
                        help="the training needles' share at depth 0 or 1 exactly (the questions ask there)")
    parser.add_argument("--passes", type=float, default=4,
                        help="how often the base stage and the fine-tune see each of their lines")
    parser.add_argument("--length", type=int, default=16384, help="the trained length: the base stage's longest line")
    parser.add_argument("--steps", type=int, default=4000,
                        help="the base stage's steps (1,500 left keys more than ~4K tokens from the question "
                             "unfound at 16,384 on the GPU; at 8,192 on CPU, 2.5 times the steps found them)")
    parser.add_argument("--factor", type=int, default=8, help="the rotary scaling's factor over --length")
    parser.add_argument("--tune-length", type=int, default=131072, help="the fine-tune's longest line")
    parser.add_argument("--finetune", type=int, default=300)
    parser.add_argument("--lr", type=float, default=5e-4, help="the base stage's")
    parser.add_argument("--finetune-lr", type=float, default=2e-4,
                        help="the fine-tune's (at --lr it undid the base stage on CPU; on the GPU 2e-4 with 30 "
                             "warmup steps retrieved better than a tenth of --lr)")
    parser.add_argument("--finetune-warmup", type=int, default=30, help="the fine-tune's warmup steps")
    parser.add_argument("--micro-batch-tokens", type=int, default=32768, help="the base stage's")
    parser.add_argument("--eval-lengths", default="4096,8192,16384,32768,65536,131072")
    parser.add_argument("--per-depth", type=int, default=4)
    parser.add_argument("--scalings", default="none,yarn")
    parser.add_argument("--jobs", type=int, default=14, help="processes writing the data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-only", action="store_true",
                        help="write OUT/data and stop: made on one machine, carried to another's OUT/data")
    parser.add_argument("--until", choices=("warm", "base", "all"), default="all",
                        help="stop after the warm stage's export (its data only: a warm model made on one machine "
                             "to carry to another's OUT/warm-hf) or the base stage's")
    args = parser.parse_args(argv)
    args.eval_lengths = [int(n) for n in args.eval_lengths.split(",")]
    if args.rope_theta < 0:
        parser.error(f"--rope-theta {args.rope_theta:g}: a rotary base is positive (or 0: the preset's own)")
    if args.finetune * 10 > args.steps + args.warm_steps:
        parser.error(f"--finetune {args.finetune}: at most a tenth of the training's steps "
                     f"({args.warm_steps} + {args.steps})")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.digits = args.digits.resolve()
    data = out / "data"
    started = time.perf_counter()
    if not (out / "warm-hf").is_dir():  # OUT/warm-hf carried in: the warm stage was trained elsewhere
        make_warm(data, args)
    if args.data_only:
        make_data(data, args)
        print(json.dumps({"data": str(data), "data_s": round(time.perf_counter() - started, 1)}))
        return 0
    timings = {"warm_data_s": round(time.perf_counter() - started, 1)}
    # The rest of the data while the warm stage trains: a second process, on the cores training leaves.
    rest = None if args.until == "warm" else subprocess.Popen(
        [sys.executable, __file__, *map(str, argv if argv is not None else sys.argv[1:]), "--data-only"])
    (out / "model.toml").write_text(preset_text(args.model, theta=args.rope_theta or None))
    recipes = {
        "warm": RECIPE.format(what=f"the warm stage: random initialisation, lines up to {args.warm_length} tokens",
                              model='preset = "model.toml"', part="-warm", steps=args.warm_steps, tokens=4096,
                              lr=1e-3, warmup=20, precision="fp32", checkpoint=500, extra=DIGITS.format(
                                  path=json.dumps(str(args.digits / "train.jsonl")), samples=args.digits_samples)),
        "base": RECIPE.format(what=f"the base stage: the warm stage's model, lines up to {args.length} tokens",
                              model='path = "warm-hf"  # the warm stage, exported', part="", steps=args.steps,
                              tokens=args.micro_batch_tokens, lr=args.lr, warmup=50, precision="bf16", checkpoint=500,
                              extra=""),
        "finetune": RECIPE.format(what=f"the trained model fine-tuned at up to {args.tune_length} tokens",
                                  model='path = "base-hf"  # the trained model, exported', part="-long",
                                  steps=args.finetune, tokens=args.tune_length, lr=args.finetune_lr,
                                  warmup=args.finetune_warmup, precision="bf16", checkpoint=100, extra="")}
    for name, text in recipes.items():
        (out / f"{name}.toml").write_text(text)
    try:
        runs = {"warm": trained(out / "warm.toml", out / "warm", out / "warm-hf")}
    except BaseException:
        if rest is not None:  # the data process ends with the run that started it
            rest.kill()
            rest.wait()
        raise
    if rest is None:
        print(json.dumps({"runs": runs, "timings": timings}))
        return 0
    if rest.wait() != 0:
        raise SystemExit(f"the data process failed (exit {rest.returncode})")
    timings["data_s"] = round(time.perf_counter() - started, 1)
    runs["base"] = trained(out / "base.toml", out / "base", out / "base-hf")
    if args.until == "base":
        print(json.dumps({"runs": runs, "timings": timings}))
        return 0
    table: dict[str, dict[str, dict[str, dict[int, float]]]] = {}
    scalings = args.scalings.split(",")
    for scaling in scalings:
        results = out / "results" / f"base-{scaling}"
        results.mkdir(parents=True, exist_ok=True)
        table[scaling] = {"before": evaluate(out / "base.toml", out / "base", data, results, scaling=scaling,
                                             args=args)}
        if scaling == "none":
            continue  # unscaled, a fine-tune at the long length is a different experiment (position interpolation's)
        runs[f"finetune-{scaling}"] = trained(out / "finetune.toml", out / f"finetune-{scaling}", None,
                                              *sets(rope(scaling, factor=args.factor, length=args.length)))
        results = out / "results" / f"finetune-{scaling}"
        results.mkdir(parents=True, exist_ok=True)
        table[scaling]["after"] = evaluate(out / "finetune.toml", out / f"finetune-{scaling}", data, results,
                                           scaling=scaling, args=args)
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
