"""Loss curves on real text: one small model, one corpus, one seed, several precisions.

    python3 benchmarks/learning/loss_curves.py --out $OUT                          # every variant, 300 steps
    python3 benchmarks/learning/loss_curves.py --out $OUT --only bf16,float8-rowwise --steps 200

Each variant is one `weft run` (its own process) of the same recipe: Qwen2.5-0.5B shapes
(random init, preset qwen2_5_0_5b) on the Python standard library's sources
(`data.source = "text"`, `<stdlib>/**/*.py`, a BPE trained on them), samples of 4,096
tokens, 16,384 tokens a step, lr 3e-4 (``--lr``) after 20 warm-up steps and decayed to 0,
seed 0; the variants differ only in their rules (below). Each run evaluates, every
``--steps``/6 steps and after its last (``[eval]``), the corpus's first ``--held-out`` samples,
which its training skips (``data.skip_samples``): the same samples for every variant, none
trained on, there however small the corpus (2026-12-02's device held ~640 samples of 4,096
tokens, fewer than the 1,200 a 300-step run takes: the runs go round it again, the held-out
samples stay out). That held-out loss is what variants are compared by. The training loss of
the last 20 steps is shown too, but it moves more between two runs than a precision does: at
lr 1e-3 (2026-12-01's lease) two bf16 seeds ended 6.5% apart, and one seed compiled and not
4.6% apart. Writes
loss_curves.json (every step's loss and tokens/s, the held-out losses, per variant),
loss_curves.md (against bf16's) and, with matplotlib, loss_curves.png. `--preset
qwen2_text_tiny --tokens 256 --batch 1024 --steps 30 --held-out 8 --emulate` runs the whole
thing in about a minute on a CPU (`--emulate`: the float8 variants' numerics without float8
matrix units). Variants already in OUT's loss_curves.json with a held-out loss are kept, not run
again: a second call adds the ones a first call's time limit left (the table compares them all).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

#: name -> (what the shard rule adds, [train] lines): the decoder layers' rule differs, the rest is shared.
VARIANTS = {
    "bf16": ('storage_dtype = "bfloat16"', ""),
    "float8-rowwise": ('storage_dtype = "bfloat16", matmul = "float8", float8_recipe = "rowwise"', ""),
    "float8-tensorwise": ('storage_dtype = "bfloat16", matmul = "float8", float8_recipe = "tensorwise"', ""),
    "bf16-round-to-nearest": ('storage_dtype = "bfloat16"', 'optimizer = "adamw"\n'),
    "float32-master": ("", ""),  # float32 weights and AdamW states, bf16 autocast
    # bf16 again from another seed (its initial weights and its data order): how far two runs
    # of one precision part at lr 1e-3, the yardstick for the others' distance from bf16.
    "bf16-seed1": ('storage_dtype = "bfloat16"', "seed = 1\n"),
}


def recipe_text(*, preset: str, tokens: int, batch: int, steps: int, shard: str, train: str,
                compile: bool = False, lr: float = 3e-4, held_out: int = 0) -> str:
    layers = ", ".join(k for k in ('strategy = "none"', shard, "compile = true" if compile else "") if k)
    seed = "" if "seed" in train else "seed = 0\n"
    rest = 'strategy = "none"' + (', storage_dtype = "bfloat16"' if "bfloat16" in shard else "")
    held = (f"[eval]\nevery = {max(1, steps // 6)}\n[eval.data]\nskip_samples = 0\nnum_samples = {held_out}\n"
            if held_out else "")
    return (f'[model]\npreset = "{preset}"\n[data]\nsource = "text"\npath = "<stdlib>/**/*.py"\ntokens = {tokens}\n'
            f"num_samples = {max(1, steps * batch // tokens)}\nskip_samples = {held_out}\n"
            f"[train]\nmax_steps = {steps}\n"
            f"micro_batch_tokens = {batch}\nlr = {lr}\nwarmup_steps = 20\nprecision = \"bf16\"\n"
            f"checkpoint_every = -1\n{seed}{train}[parallel]\nnproc = 1\n{held}"
            f'[[rules]]\nname = "the variant\'s layers"\nwhen = {{ path = "*.layers.*" }}\nshard = {{ {layers} }}\n'
            f'[[rules]]\nname = "the rest"\nshard = {{ {rest} }}\n')


#: steps in the plot's moving mean
SMOOTH = 20


def moving_mean(values: list[float], *, width: int = SMOOTH) -> list[float]:
    """Each value's mean with the ``width - 1`` before it (fewer at the start)."""
    return [sum(values[max(0, i + 1 - width):i + 1]) / (i + 1 - max(0, i + 1 - width)) for i in range(len(values))]


def final_loss(losses: list[float], *, tail: int = 20) -> float:
    return sum(losses[-tail:]) / len(losses[-tail:])


def table(results: dict) -> list[str]:
    """The markdown rows: each variant's held-out loss and last-20 training loss against bf16's."""
    base = results.get("bf16", {})
    ref_held = base.get("held_out")
    ref_train = final_loss(base["loss"]) if base.get("loss") else None
    versus = lambda value, ref: f"{(value / ref - 1) * 100:+.2f}%" if value and ref else ""  # noqa: E731
    lines = ["| variant | steps | held-out loss | vs bf16 | training loss (last 20) | vs bf16 | tokens/s (steps 5..) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if not r["loss"]:
            lines.append(f"| {name} | failed (rc {r['rc']}, see {name}.log) | | | | | |")
            continue
        loss, held = final_loss(r["loss"]), r.get("held_out")
        speed = r["tokens_per_s"][4:] or r["tokens_per_s"]
        lines.append(f"| {name} | {len(r['loss'])} | {f'{held:.4f}' if held else '—'} | {versus(held, ref_held)} | "
                     f"{loss:.4f} | {versus(loss, ref_train)} | {sum(speed) / len(speed):,.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preset", default="qwen2_5_0_5b")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=16384, help="tokens per step")
    parser.add_argument("--emulate", action="store_true",
                        help="float8 variants with float8_emulate = true (their numerics on a CPU, not their speed)")
    parser.add_argument("--compile", action="store_true",
                        help="the layers' children through torch.compile (every variant alike): float8's casts fused, "
                             "its speed torchao's, not an unfused cast's")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--held-out", type=int, default=64,
                        help="the corpus's first samples: every training run skips them, each run is evaluated "
                             "on them (0: none)")
    parser.add_argument("--plot", type=pathlib.Path, metavar="JSON",
                        help="no runs: the table and the PNG from a loss_curves.json already made (e.g. the GPU's)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    done_before = args.out / "loss_curves.json"
    results = json.loads((args.plot or done_before).read_text()) if args.plot or done_before.is_file() else {}
    for name in [] if args.plot else args.only.split(","):
        if results.get(name, {}).get("held_out") is not None:
            print(name, "kept from", done_before, flush=True)
            continue
        shard, train = VARIANTS[name]
        if args.emulate and "float8" in shard:
            shard += ", float8_emulate = true"
        recipe = args.out / f"{name}.toml"
        text = recipe_text(preset=args.preset, tokens=args.tokens, batch=args.batch, steps=args.steps,
                           shard=shard, train=train, compile=args.compile, lr=args.lr, held_out=args.held_out)
        recipe.write_text(text)
        run = args.out / name
        done = subprocess.run([sys.executable, "-m", "weft", "run", str(recipe), "--run-dir", str(run)],
                              capture_output=True, text=True)
        (args.out / f"{name}.log").write_text(done.stdout + done.stderr)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line] if (run / "metrics.jsonl").is_file() else []
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # none written (checkpoint_every = -1): none kept
        curve = [[r["step"], r["eval_loss"]] for r in rows if "eval_loss" in r]  # [eval]'s rows
        results[name] = {"rc": done.returncode, "loss": [r["loss"] for r in rows],
                         "tokens_per_s": [r["tokens_per_s"] for r in rows], "held_out_curve": curve,
                         "held_out": curve[-1][1] if done.returncode == 0 and curve else None}
        print(name, "rc", done.returncode, "steps", len(rows), "held-out", results[name]["held_out"], flush=True)
        # After each variant: a run cut short by its call's limit keeps the variants done (--plot redraws them).
        (args.out / "loss_curves.json").write_text(json.dumps(results, indent=1))
    (args.out / "loss_curves.json").write_text(json.dumps(results, indent=1))
    lines = table(results)
    (args.out / "loss_curves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    # Top: each run's loss, smoothed (a step's loss is one batch's: the batches differ more than
    # the precisions do). Bottom: each seed-0 run against bf16 on the very same batches, step by
    # step: the comparison the 1.5% bar is judged by.
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    base = results.get("bf16", {}).get("loss") or []
    for name, r in results.items():
        if not r["loss"]:
            continue
        steps = range(1, len(r["loss"]) + 1)
        line, = top.plot(steps, moving_mean(r["loss"]), label=name, linewidth=1.2)
        if r.get("held_out_curve"):  # the held-out loss at each evaluation, dashed in the run's colour
            top.plot(*zip(*r["held_out_curve"]), color=line.get_color(), linestyle="--", marker="o", markersize=3)
        if name != "bf16" and "seed" not in name and base:
            paired = [(x / y - 1) * 100 for x, y in zip(r["loss"], base)]
            bottom.plot(range(1, len(paired) + 1), moving_mean(paired), label=name, linewidth=1.2)
    top.set_ylabel(f"loss ({SMOOTH}-step mean; dashed: held out)")
    top.set_title(f"{args.preset} on the Python standard library, {args.batch:,} tokens a step")
    top.legend()
    for bar in (-1.5, 1.5):
        bottom.axhline(bar, color="grey", linestyle=":", linewidth=1)
    bottom.axhline(0, color="black", linewidth=0.6)
    bottom.set_ylabel(f"vs bf16, same batches, % ({SMOOTH}-step mean)")
    bottom.set_xlabel("step")
    if any(line.get_label() in results for line in bottom.lines):
        bottom.legend()
    fig.tight_layout()
    fig.savefig(args.out / "loss_curves.png", dpi=120)


if __name__ == "__main__":
    main()
