"""torchtitan beside weft on the same GPUs: a Llama-3-8B-shaped model with context parallelism.

    python3 benchmarks/step/torchtitan_side.py --out $OUT --wheels .whl/torchtitan --gpus 2 --seq-len 131072

Issue 13 asks for a peer measured in the same run. torchtitan (PyPI ``torchtitan``) is the
closest: FSDP2 + context parallelism (ring over torch's SDPA) + selective or full
activation checkpointing + torch.compile, on a Llama-3.1-8B shape (4,096 wide, 32 layers,
32 query / 8 KV heads, 128,256 vocabulary). Release 0.2.1 imports on the GPU machine's
torch with a handful of small wheels carried (torchtitan, torchdata, datasets, dill,
multiprocess, tyro, docstring-parser, typeguard, shtab, tomli: ~2 MB; pandas, pyarrow,
tensorboard, tokenizers are there already). Nothing of torchtitan's repository is used:
this script writes its own inputs: a word-level tokenizer (the model's vocabulary is the
flavor's, 128,256, whatever the tokenizer's), a folder of synthetic text in the layout of
torchtitan's ``c4_test`` dataset, and a job config of our own choosing. It then runs
``torchrun -m torchtitan.train`` for ``--steps`` steps and reads torchtitan's own metrics
line (tokens/s per GPU, MFU, peak reserved memory) of the last step. weft's side is
``benchmarks/step/scaling.py`` with the ``qwen2.5-7b-128k-2gpu`` recipe (Qwen2.5-7B: 3,584 wide,
28 layers, 152,064 vocabulary: ~7% fewer FLOPs per token than Llama-3.1-8B; compare MFU).
Writes torchtitan.json and torchtitan.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import subprocess
import sys

WORDS = 4096  # the tokenizer's own vocabulary (ids stay below the model's 128,256)


def install(wheels: pathlib.Path, site: pathlib.Path) -> None:
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"no wheels in {wheels}: download them as this script's docstring says")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, found)], check=True)


def write_tokenizer(folder: pathlib.Path) -> None:
    """A word-level tokenizer over WORDS made-up words, with begin and end tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))


def write_data(folder: pathlib.Path, *, documents: int = 512, words: int = 2048) -> None:
    """Synthetic documents, one JSON object with a "text" field per line (c4_test's layout)."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "data.json").open("w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(WORDS)}" for _ in range(words))}) + "\n")


def write_config(path: pathlib.Path, *, assets: pathlib.Path, data: pathlib.Path, out: pathlib.Path, seq_len: int,
                 steps: int, cp: int, ac: str, compile_: bool) -> None:
    path.write_text(f"""
[job]
dump_folder = "{out}"
description = "Llama-3.1-8B shape beside weft (benchmarks/step/torchtitan_side.py)"

[metrics]
log_freq = 1

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "{assets}"

[optimizer]
name = "AdamW"
lr = 3e-4

[lr_scheduler]
warmup_steps = 1

[training]
local_batch_size = 1
seq_len = {seq_len}
max_norm = 1.0
steps = {steps}
dataset = "c4_test"
dataset_path = "{data}"
mixed_precision_param = "bfloat16"

[parallelism]
data_parallel_shard_degree = -1
context_parallel_degree = {cp}

[activation_checkpoint]
mode = "{ac}"
selective_ac_option = "op"

[compile]
enable = {str(compile_).lower()}
components = ["model", "loss"]
""")


LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--wheels", type=pathlib.Path, default=pathlib.Path(".whl/torchtitan"))
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--cp", type=int, default=0, help="context-parallel degree (default: all GPUs)")
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ac", default="full", choices=("full", "selective", "none"))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--timeout", type=int, default=560)
    args = parser.parse_args()
    root = args.out / "torchtitan"
    site = pathlib.Path("/tmp/torchtitan-site")
    install(args.wheels, site)
    write_tokenizer(root / "assets")
    write_data(root / "data")
    config = root / "llama3_8b.toml"
    write_config(config, assets=root / "assets", data=root / "data", out=root / "dump", seq_len=args.seq_len,
                 steps=args.steps, cp=args.cp or args.gpus, ac=args.ac, compile_=args.compile)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
               "-m", "torchtitan.train", "--job.config_file", str(config)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=root)
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        log, code = (expired.stdout or b"").decode() + (expired.stderr or b"").decode(), "timeout"
    (root / "log.txt").write_text(log)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)  # torchtitan colours its metrics line
    steps = [m.groups() for m in LINE.finditer(plain)]
    result = {"exit": code, "gpus": args.gpus, "cp": args.cp or args.gpus, "seq_len": args.seq_len, "ac": args.ac,
              "compile": args.compile, "steps": [{"step": int(s), "max_reserved_gib": float(mem),
                                                  "tokens_per_s_per_gpu": int(tps.replace(",", "")),
                                                  "mfu": float(mfu) / 100} for s, mem, tps, mfu in steps]}
    if not steps:
        result["tail"] = plain[-3000:]
    (args.out / "torchtitan.json").write_text(json.dumps(result, indent=1))
    last = result["steps"][-1] if steps else None
    line = (f"| torchtitan 0.2.1, Llama-3.1-8B shape | {args.gpus} | CP {result['cp']} | {args.seq_len:,} | "
            + (f"{last['tokens_per_s_per_gpu']:,} | {100 * last['mfu']:.1f}% | {last['max_reserved_gib']:.1f} |"
               if last else f"exit {code}: see torchtitan/log.txt | | |"))
    (args.out / "torchtitan.md").write_text("| run | GPUs | parallelism | tokens | tokens/s per GPU | MFU | peak "
                                            "reserved GiB |\n|---|---:|---|---:|---:|---:|---:|\n" + line + "\n")
    print(line)


if __name__ == "__main__":
    main()
