"""Loss curves on real text: one small model, one corpus, one seed, several precisions.

    python3 benchmarks/loss_curves.py --out $OUT                          # every variant, 300 steps
    python3 benchmarks/loss_curves.py --out $OUT --only bf16,float8-rowwise --steps 200

Each variant is one `weft run` (its own process) of the same recipe: Qwen2.5-0.5B shapes
(random init, preset qwen2_5_0_5b) on the Python standard library's sources
(`data.source = "text"`, `<stdlib>/**/*.py`, a BPE trained on them), samples of 4,096
tokens, 16,384 tokens a step, lr 1e-3 after 20 warm-up steps, seed 0; the variants differ
only in their rules (below). Writes loss_curves.json (every step's loss and tokens/s per
variant), loss_curves.md (final loss = mean of the last 20 steps, against bf16's) and, with
matplotlib, loss_curves.png. `--preset qwen2_text_tiny --tokens 256 --batch 1024 --emulate` runs
the whole thing in seconds on a CPU (`--emulate`: the float8 variants' numerics without
float8 matrix units).
"""

from __future__ import annotations

import argparse
import json
import pathlib
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
                compile: bool = False) -> str:
    layers = ", ".join(k for k in ('strategy = "none"', shard, "compile = true" if compile else "") if k)
    seed = "" if "seed" in train else "seed = 0\n"
    rest = 'strategy = "none"' + (', storage_dtype = "bfloat16"' if "bfloat16" in shard else "")
    return (f'[model]\npreset = "{preset}"\n[data]\nsource = "text"\npath = "<stdlib>/**/*.py"\ntokens = {tokens}\n'
            f"num_samples = {max(1, steps * batch // tokens)}\n[train]\nmax_steps = {steps}\n"
            f"micro_batch_tokens = {batch}\nlr = 1e-3\nwarmup_steps = 20\nprecision = \"bf16\"\n"
            f"checkpoint_every = -1\n{seed}{train}[parallel]\nnproc = 1\n"
            f'[[rules]]\nname = "the variant\'s layers"\nwhen = {{ path = "*.layers.*" }}\nshard = {{ {layers} }}\n'
            f'[[rules]]\nname = "the rest"\nshard = {{ {rest} }}\n')


def final_loss(losses: list[float], *, tail: int = 20) -> float:
    return sum(losses[-tail:]) / len(losses[-tail:])


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
    parser.add_argument("--plot", type=pathlib.Path, metavar="JSON",
                        help="no runs: the table and the PNG from a loss_curves.json already made (e.g. the GPU's)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.plot.read_text()) if args.plot else {}
    for name in [] if args.plot else args.only.split(","):
        shard, train = VARIANTS[name]
        if args.emulate and "float8" in shard:
            shard += ", float8_emulate = true"
        recipe = args.out / f"{name}.toml"
        recipe.write_text(recipe_text(preset=args.preset, tokens=args.tokens, batch=args.batch, steps=args.steps,
                                      shard=shard, train=train, compile=args.compile))
        run = args.out / name
        done = subprocess.run([sys.executable, "-m", "weft", "run", str(recipe), "--run-dir", str(run)],
                              capture_output=True, text=True)
        (args.out / f"{name}.log").write_text(done.stdout + done.stderr)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line] if (run / "metrics.jsonl").is_file() else []
        results[name] = {"rc": done.returncode, "loss": [r["loss"] for r in rows],
                         "tokens_per_s": [r["tokens_per_s"] for r in rows]}
        print(name, "rc", done.returncode, "steps", len(rows), flush=True)
    (args.out / "loss_curves.json").write_text(json.dumps(results, indent=1))
    reference = final_loss(results["bf16"]["loss"]) if results.get("bf16", {}).get("loss") else None
    lines = ["| variant | steps | final loss (last 20) | vs bf16 | tokens/s (steps 5..) |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        if not r["loss"]:
            lines.append(f"| {name} | failed (rc {r['rc']}, see {name}.log) | | | |")
            continue
        loss = final_loss(r["loss"])
        speed = r["tokens_per_s"][4:] or r["tokens_per_s"]
        versus = f"{(loss / reference - 1) * 100:+.2f}%" if reference else ""
        lines.append(f"| {name} | {len(r['loss'])} | {loss:.4f} | {versus} | {sum(speed) / len(speed):,.0f} |")
    (args.out / "loss_curves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        if r["loss"]:
            ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{args.preset} on the Python standard library, {args.batch:,} tokens a step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "loss_curves.png", dpi=120)


if __name__ == "__main__":
    main()
