"""Write the GPU variant of the digits example: rows of handwritten digits read left to right.

    python examples/digits/make_grids.py OUT_DIR [--train 12000] [--held-out 200] [--side 56]

Each image is 3 to 8 of scikit-learn's digits side by side, each ``side`` px square (56: an
8x8 digit's cell is 7 px, one merged vision token is 28 px, so a digit is 4 image tokens and a
row of 8 is 32), so the width — and the image-token count — changes from sample to sample
(Qwen2.5-VL's dynamic resolution). The question is "Read the digits from left to right.",
the answer the digit string ("31415"), scored by exact match of the whole string. Train rows
use only make_digits.py's training digits and held-out rows only its held-out digits (the
same stratified split, by ``--seed``), so no held-out digit was ever seen in training.

Writes OUT_DIR/images/, train.jsonl, held_out.jsonl, and OUT_DIR/processor/: the bundled
tiny_vl tokenizer and template with an image processor whose ``max_pixels`` holds a row of
8 unresized (the bundled one caps images at 19,600 px for the CPU examples).
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import pathlib
import random
import shutil
import sys
from collections.abc import Sequence

# Run as a script, this folder is on sys.path: the single digits' drawing and split are reused.
from make_digits import SIDE_STEP, digit_image, stratified_split, write_jsonl
from PIL import Image

PROMPT = "<image>Read the digits from left to right."
LENGTHS = range(3, 9)  # digits in a row


def row_image(*, pixels: Sequence, side: int) -> Image.Image:
    """Digits side by side, each side x side (white ink on black, as make_digits draws one)."""
    row = Image.new("RGB", (side * len(pixels), side))
    for k, one in enumerate(pixels):
        row.paste(digit_image(pixels=one, side=side), (k * side, 0))
    return row


def rows(*, indices: Sequence[int], count: int, rng: random.Random) -> list[list[int]]:
    """``count`` rows of dataset indices drawn from ``indices``, 3 to 8 each."""
    return [rng.sample(indices, rng.choice(LENGTHS)) for _ in range(count)]


def processor_folder(out: pathlib.Path, *, max_pixels: int) -> None:
    """The bundled tiny_vl processor with room for a whole row of digits."""
    bundled = importlib.resources.files("weft.recipes") / "tiny_vl"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        with importlib.resources.as_file(bundled / name) as source:
            shutil.copy(source, out / name)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config["max_pixels"] = config["size"]["longest_edge"] = max_pixels
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_grids(*, out_dir: pathlib.Path, train: int, held_out: int, side: int, seed: int) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    labels = [int(label) for label in digits.target]
    train_ids, held_ids = stratified_split(labels=labels, held_out=0.2, seed=seed)
    rng = random.Random(seed)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    for split, indices, count in (("train", train_ids, train), ("held_out", held_ids, held_out)):
        lines = []
        for number, row in enumerate(rows(indices=indices, count=count, rng=rng)):
            name = f"images/{split}-{number:05d}.png"
            # Greyscale on disk (a third of RGB's bytes); the image processor converts it to RGB.
            row_image(pixels=[digits.images[i].tolist() for i in row], side=side).convert("L").save(out_dir / name)
            answer = "".join(str(labels[i]) for i in row)
            lines.append({"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": answer}],
                          "images": [name], "id": f"{split}-{number:05d}", "answer": answer})
        write_jsonl(path=out_dir / f"{split}.jsonl", rows=lines)
    processor_folder(out_dir / "processor", max_pixels=side * side * max(LENGTHS))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--train", type=int, default=12000, help="training rows (default 12000)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out rows (default 200)")
    parser.add_argument("--side", type=int, default=56, help=f"a digit's side in px, a multiple of {SIDE_STEP} "
                        "(default 56; at 112 the models here stayed at chance: BENCHMARKS.md)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the rows (default 0)")
    args = parser.parse_args(argv)
    if args.side < SIDE_STEP or args.side % SIDE_STEP:
        parser.error(f"--side {args.side}: must be a positive multiple of {SIDE_STEP}")
    make_grids(out_dir=args.out_dir, train=args.train, held_out=args.held_out, side=args.side, seed=args.seed)
    print(f"{args.out_dir}: {args.train} train rows, {args.held_out} held out, digits {args.side} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
