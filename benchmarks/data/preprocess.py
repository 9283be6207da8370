"""Data pipeline throughput: JSONL + PNG files through the Qwen2.5-VL image processor.

Writes a dataset of conversations with real PNG images (sizes around 448 px, the
Qwen2.5-VL fine-tuning norm) and a few hundred words of text, then measures samples/s
and tokens/s of weft's preprocessing (parse, decode, RGB, the model's own image
processor with its default pixel limits, tokenize, labels) with the default number of
worker processes, cold (no cache) and warm (from the on-disk cache).

    python3 benchmarks/data/preprocess.py --out $OUT [--samples 400]

Compare with what one H200 consumes training Qwen2.5-VL-7B at 32K: 6,008 tokens/s
(plain transformers, shared/anchors.md; the same machine kind).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

from PIL import Image, ImageDraw  # noqa: E402

H200_7B_32K_TOKENS_PER_S = 6008  # shared/anchors.md, plain transformers on one H200

WORDS = (
    "the a image shows colour shape left right above below large small red blue green square circle line text"
).split()


def processor_folder(root: pathlib.Path) -> pathlib.Path:
    """The bundled tiny tokenizer with Qwen2.5-VL's real image-processor settings."""
    from weft.strategies.data.conversation import processor_dir

    folder = root / "processor"
    shutil.copytree(processor_dir("tiny_vl"), folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    # Qwen2.5-VL's released preprocessor: 56x56 .. 28*28*1280 pixels per image.
    config.update({"min_pixels": 3136, "max_pixels": 1003520, "size": {"shortest_edge": 3136, "longest_edge": 1003520}})
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


def make_dataset(root: pathlib.Path, *, samples: int, seed: int = 0) -> pathlib.Path:
    rng = random.Random(seed)
    images = root / "images"
    images.mkdir(parents=True)
    lines = []
    for i in range(samples):
        size = (rng.randint(336, 560), rng.randint(336, 560))
        image = Image.new("RGB", size, tuple(rng.randint(0, 255) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(20):
            x, y = rng.randint(0, size[0] - 40), rng.randint(0, size[1] - 40)
            draw.rectangle(
                [x, y, x + rng.randint(5, 40), y + rng.randint(5, 40)],
                fill=tuple(rng.randint(0, 255) for _ in range(3)),
            )
        image.save(images / f"{i}.png")
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 300)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 200)))
        lines.append(json.dumps({
            "messages": [{"role": "user", "content": "<image>" + question}, {"role": "assistant", "content": answer}],
            "images": [f"images/{i}.png"],
        }))
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def measure(path: pathlib.Path, *, processor: pathlib.Path, workers: int, cache: pathlib.Path | None) -> dict:
    from weft.strategies.data import datasets

    start = time.perf_counter()
    samples = tokens = bad = 0
    for sample in datasets.jsonl_samples(path, processor=str(processor), workers=workers, cache_dir=cache):
        if isinstance(sample, datasets.BadSample):
            bad += 1
            continue
        samples += 1
        tokens += sample.num_tokens
    seconds = time.perf_counter() - start
    return {
        "samples": samples,
        "bad": bad,
        "tokens": tokens,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "tokens_per_s": tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--workers", type=int, default=-1, help="-1: weft's default (min(8, cores - 1))")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args()
    from weft.strategies.data.preprocess import default_workers

    workers = default_workers() if args.workers == -1 else args.workers
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        processor = processor_folder(root)
        path = make_dataset(root, samples=args.samples)
        warm = make_dataset(root / "warmup", samples=4, seed=1)
        measure(warm, processor=processor, workers=1, cache=None)  # imports and first-call costs, untimed
        cache = root / "cache"
        rows = {
            "cold, 1 process": measure(path, processor=processor, workers=1, cache=None),
            f"cold, {workers} workers (default)": measure(path, processor=processor, workers=workers, cache=cache),
            f"warm cache, {workers} workers": measure(path, processor=processor, workers=workers, cache=cache),
        }
    lines = [
        f"Machine: {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; {args.samples} samples, "
        "one 336-560 px PNG each "
        f"(~{rows['cold, 1 process']['tokens'] // max(1, rows['cold, 1 process']['samples'])} tokens per sample).",
        "",
        "| pipeline | samples/s | tokens/s | x one H200's 7B@32K consumption (6,008 tok/s) |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['samples_per_s']:.1f} | {row['tokens_per_s']:,.0f} "
            f"| {row['tokens_per_s'] / H200_7B_32K_TOKENS_PER_S:.1f}x |"
        )

    text = "\n".join(lines)
    print(text)
    (args.out / "data.md").write_text(text + "\n")
    (args.out / "data.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
