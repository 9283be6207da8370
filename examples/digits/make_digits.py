"""Write scikit-learn's handwritten digits as a weft chat dataset.

    python examples/digits/make_digits.py OUT_DIR [--seed 0] [--side 56] [--held-out 0.2]

writes OUT_DIR/images/NNNN.png (NNNN: the sample's index in ``load_digits``),
OUT_DIR/train.jsonl and OUT_DIR/held_out.jsonl in the sharegpt-style messages format
of docs/data.md, with image paths relative to the JSONL files (and train_words.jsonl,
held_out_words.jsonl: the same split answered "seven", for the LoRA example; train_pairs.jsonl,
held_out_prefer.jsonl: the plain question with the word preferred to the numeral, for the
preference example, examples/digits/prefer.toml):

    {"messages": [{"role": "user", "content": "<image>Which digit is this?"},
                  {"role": "assistant", "content": "7"}],
     "images": ["images/0007.png"], "id": "digits-0007", "answer": "7"}

The data ships inside the scikit-learn wheel (``pip install 'weft[digits]'``): 1,797
8x8 greyscale images of 0-16 ink, nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
from collections import defaultdict
from collections.abc import Sequence

from PIL import Image

PROMPT = "<image>Which digit is this?"
# The LoRA example's new answer format (examples/digits/words.toml): the same images,
# the digit as an English word.
WORDS_PROMPT = "<image>Which digit is this? Answer in words."
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# The vision tower cuts 14-px patches and merges them 2x2, so a side that is a multiple
# of 28 maps to whole merged tokens and the image processor does not resample it.
SIDE_STEP = 28


def digit_image(*, pixels: Sequence[Sequence[float]], side: int) -> Image.Image:
    """One 8x8 digit (ink 0..16) as a side x side RGB image: white ink on black.

    White on black keeps the dataset's own polarity (a pixel's value is its ink, as in
    MNIST), so the background is exactly 0 and no value is inverted. Nearest-neighbour
    upscaling keeps the 64 cells as flat squares instead of inventing blurred strokes.
    """
    grey = Image.new("L", (8, 8))
    grey.putdata([round(value * 255 / 16) for row in pixels for value in row])
    # RGB because the image processor normalises three channels (CLIP mean/std).
    return grey.resize((side, side), Image.Resampling.NEAREST).convert("RGB")


def stratified_split(*, labels: Sequence[int], held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices (train, held-out): the same fraction of every digit held out, drawn by `seed`.

    Stratifying keeps the held-out accuracy a fair average over the ten classes; the
    per-class shuffle uses its own Random so the split depends on nothing but the seed.
    """
    rng = random.Random(seed)
    by_digit: dict[int, list[int]] = defaultdict(list)
    for index, label in enumerate(labels):
        by_digit[label].append(index)
    train, held = [], []
    for digit in sorted(by_digit):
        indices = by_digit[digit]
        rng.shuffle(indices)
        cut = round(len(indices) * held_out)
        held.extend(indices[:cut])
        train.extend(indices[cut:])
    # Sorted so the files read in dataset order; weft shuffles training samples itself.
    return sorted(train), sorted(held)


def record(*, index: int, label: int, words: bool = False) -> dict:
    """One sample in docs/data.md's messages format; `id` and `answer` are for scoring."""
    answer = WORDS[label] if words else str(label)
    return {
        "messages": [{"role": "user", "content": WORDS_PROMPT if words else PROMPT},
                     {"role": "assistant", "content": answer}],
        "images": [f"images/{index:04d}.png"],
        "id": f"digits-{index:04d}",
        "answer": answer,
    }


def pair(*, index: int, label: int) -> dict:
    """One preference pair in TRL's conversational fields: the plain question, the word chosen
    over the numeral (examples/digits/prefer.toml)."""
    return {
        "prompt": [{"role": "user", "content": PROMPT}],
        "chosen": [{"role": "assistant", "content": WORDS[label]}],
        "rejected": [{"role": "assistant", "content": str(label)}],
        "images": [f"images/{index:04d}.png"],
        "id": f"digits-{index:04d}",
    }


def preferred(*, index: int, label: int) -> dict:
    """A held-out question of the preference example: the plain question, the word its answer,
    the digit in ``meta`` (examples/digits/score_words.py counts words, numerals, right digits)."""
    row = record(index=index, label=label, words=True)
    row["messages"][0]["content"] = PROMPT
    return dict(row, meta={"digit": label})


def write_jsonl(*, path: pathlib.Path, rows: Sequence[dict]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def make_digits(*, out_dir: pathlib.Path, seed: int, side: int, held_out: float) -> tuple[int, int]:
    """Write the images and the JSONL files (digits, and words for the LoRA example);
    returns (train, held-out) sample counts."""
    # Imported here so `--help` works without scikit-learn installed.
    from sklearn.datasets import load_digits

    digits = load_digits()
    labels = [int(label) for label in digits.target]
    images_dir = out_dir / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    for index, pixels in enumerate(digits.images):
        digit_image(pixels=pixels.tolist(), side=side).save(images_dir / f"{index:04d}.png")
    train, held = stratified_split(labels=labels, held_out=held_out, seed=seed)
    write_jsonl(path=out_dir / "train.jsonl", rows=[record(index=i, label=labels[i]) for i in train])
    write_jsonl(path=out_dir / "held_out.jsonl", rows=[record(index=i, label=labels[i]) for i in held])
    write_jsonl(path=out_dir / "train_words.jsonl", rows=[record(index=i, label=labels[i], words=True) for i in train])
    write_jsonl(path=out_dir / "held_out_words.jsonl",
                rows=[record(index=i, label=labels[i], words=True) for i in held])
    write_jsonl(path=out_dir / "train_pairs.jsonl", rows=[pair(index=i, label=labels[i]) for i in train])
    write_jsonl(path=out_dir / "held_out_prefer.jsonl", rows=[preferred(index=i, label=labels[i]) for i in held])
    return len(train), len(held)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path,
                        help="folder for images/, train.jsonl, held_out.jsonl and their _words twins")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/held-out split (default 0)")
    parser.add_argument("--side", type=int, default=56,
                        help=f"image side in px, a multiple of {SIDE_STEP} (default 56: the bundled tiny_vl "
                             "processor's smallest image, 4 merged tokens)")
    parser.add_argument("--held-out", type=float, default=0.2, help="fraction of each digit held out (default 0.2)")
    args = parser.parse_args(argv)
    if args.side < SIDE_STEP or args.side % SIDE_STEP:
        parser.error(f"--side {args.side}: must be a positive multiple of {SIDE_STEP} (14-px patches merged 2x2)")
    if not 0.0 < args.held_out < 1.0:
        parser.error(f"--held-out {args.held_out}: must be between 0 and 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    n_train, n_held = make_digits(out_dir=args.out_dir, seed=args.seed, side=args.side, held_out=args.held_out)
    print(f"{args.out_dir}: {n_train} train, {n_held} held out, images {args.side}x{args.side}")


if __name__ == "__main__":
    main()
