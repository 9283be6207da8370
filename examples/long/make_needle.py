"""A multimodal needle: one image of a handwritten digit (scikit-learn's, as examples/digits draws
them) at a chosen depth of a long standard-library text, among distractor digits, each image after
a name; the question asks for the digit in the image after one name.

    python examples/long/make_needle.py OUT_DIR [--processor tiny_vl] [--train-length 2048]
        [--train-samples 2000] [--lengths 2048,8192] [--depths 0,0.25,0.5,0.75,1]
        [--per-depth 8] [--distractors 2] [--seed 0]

writes OUT_DIR/images (the digits example's images: ``--digits DIR``, else made into OUT_DIR/digits by
examples/digits/make_digits.py), OUT_DIR/train.jsonl (conversations
of exactly ``--train-length`` tokens, their images from the digits' training split and their text
from the corpus's training files) and OUT_DIR/needle-N.jsonl for each N of ``--lengths``: questions
whose prompt is exactly N tokens (the images' vision tokens counted), the needle at each of
``--depths``, the distractors at random depths, images from the held-out digits, text from the
held-out files. A question's line:

    {"messages": [{"role": "user", "content": "... Image of Quill: <image> ... Which digit is in the
     image of Quill?"}], "images": ["images/0412.png", "images/0007.png", "images/1290.png"],
     "answer": "The image of Quill shows 4.", "meta": {"task": "needle", "length": 8192, "depth": 0.5,
     "name": "Quill", "digit": 4, ...}}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
from collections.abc import Sequence

from weft.core.whole_files import written_whole

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "digits"))
from haystack import Corpus, Encoder, add_line_arguments, draw_depth, draw_length, fit, insert_at, line_makers  # noqa: E402

INTRO = ("Some images of handwritten digits are hidden inside a lot of irrelevant text, each after a name. "
         "I will ask you about one of them.\n")
NAMES = ("Quill", "Marlow", "Tansy", "Brio", "Oskar", "Wren", "Juniper", "Cato", "Fennel", "Ines", "Yarrow", "Bede")


def marker(name: str) -> str:
    return f"Image of {name}: <image>\n"


def question(name: str) -> str:
    return f"\nWhich digit is in the image of {name}?"


def reply(name: str, digit: str) -> str:
    """The answer: the digit in a sentence that names the image first, so that the name asked
    about is a few tokens before the digit the model writes (the passkey's reply is built so too)."""
    return f"The image of {name} shows {digit}."


def needle_record(haystack: str, *, needles: list[tuple[float, str, str]], asked: str, answer: str | None) -> dict:
    """``needles``: (depth, name, image path); the first is the one asked about. Distractors go in
    first, the needle last, so the needle's depth is where its line says in the final text."""
    text = haystack
    for depth, name, _ in needles[1:]:
        text, _ = insert_at(text, marker(name), depth=depth)
    text, _ = insert_at(text, marker(needles[0][1]), depth=needles[0][0])
    order = sorted(needles, key=lambda n: text.index(marker(n[1])))
    record = {"messages": [{"role": "user", "content": INTRO + text + question(asked)}],
              "images": [path for _, _, path in order]}
    if answer is not None:
        record["messages"].append({"role": "assistant", "content": answer})
    return record


def needle_line(corpus: Corpus, encoder: Encoder, *, length: int, depth: float, pool: list[int], labels: dict,
                distractors: int, rng: random.Random, answer: bool) -> dict:
    names = rng.sample(NAMES, distractors + 1)
    chosen = [rng.choice(pool) for _ in names]
    needles = [(depth, names[0], f"images/{chosen[0]:04d}.png")]
    needles += [(rng.random(), n, f"images/{c:04d}.png") for n, c in zip(names[1:], chosen[1:])]
    digit = reply(names[0], str(labels[chosen[0]]))
    for _ in range(20):
        text, files = corpus.slice(4 * length + 4096, rng=rng)
        try:
            record = fit(lambda n: needle_record(text[:n], needles=needles, asked=names[0],
                                                 answer=digit if answer else None),
                         count=lambda r: len(encoder.ids(r, prompt=not answer)), length=length, start=length,
                         limit=len(text))
        except ValueError:
            continue
        return dict(record, answer=digit, meta={"task": "needle", "length": length, "depth": depth,
                                                 "name": names[0], "image": chosen[0],
                                                 "digit": labels[chosen[0]], "files": files,
                                                 "distractors": [c for c in chosen[1:]]})
    raise RuntimeError(f"could not build a needle line of {length} tokens at depth {depth}")


#: Each process's encoder, corpora and digits (the pool's initializer fills it).
_STATE: dict = {}


def _start(processor: str, base: str, labels: dict, split: dict, distractors: int) -> None:
    _STATE.update(encoder=Encoder(processor, base=pathlib.Path(base)), train=None, held_out=None, labels=labels,
                  split=split, distractors=distractors)


def make_line(job: tuple) -> dict:
    """One line from its own seed: ``job`` is (part, length, depth or None, seed text); the needle's
    image from that part of the digits, the text from that part of the corpus."""
    part, length, depth, seed = job
    if _STATE[part] is None:
        _STATE[part] = Corpus.of(part)
    rng = random.Random(seed)
    return needle_line(_STATE[part], _STATE["encoder"], length=length, depth=rng.random() if depth is None else depth,
                       pool=_STATE["split"][part], labels=_STATE["labels"], distractors=_STATE["distractors"],
                       rng=rng, answer=part == "train")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_line_arguments(parser, train_length=2048, train_samples=2000, lengths="2048,8192", needle="needles")
    parser.add_argument("--distractors", type=int, default=2)
    parser.add_argument("--side", type=int, default=56, help="the digits' side in pixels when they are made here")
    parser.add_argument("--digits", type=pathlib.Path, default=None,
                        help="examples/digits/make_digits.py's folder (images/, train.jsonl, held_out.jsonl) to take "
                             "the digits and their split from (default: made into OUT_DIR/digits, scikit-learn "
                             "needed)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    digits = args.digits or args.out / "digits"
    if args.digits is None and not (digits / "held_out.jsonl").is_file():
        import make_digits  # scikit-learn's digits (pip install 'weft[digits]'), drawn as the digits example draws them

        make_digits.main([str(digits), "--side", str(args.side), "--seed", str(args.seed)])
    labels, split = {}, {}
    for part in ("train", "held_out"):
        rows = [json.loads(x) for x in (digits / f"{part}.jsonl").read_text().splitlines()]
        split[part] = [int(r["id"].rsplit("-", 1)[1]) for r in rows]
        labels.update({int(r["id"].rsplit("-", 1)[1]): int(r["answer"]) for r in rows})
    images = args.out / "images"  # the needles' paths are relative to the JSONL files: OUT_DIR/images
    if not images.exists():
        images.symlink_to((digits / "images").resolve(), target_is_directory=True)
    depths = [float(d) for d in args.depths.split(",")]
    pick = random.Random(f"{args.seed}:lengths")
    low = args.train_min_length or args.train_length
    jobs = [("train", draw_length(pick, low=low, high=args.train_length, log=args.log_lengths,
                                  long_share=args.long_share),
             draw_depth(pick, edges=args.edge_depths) if args.edge_depths else None, f"{args.seed}:train:{i}")
            for i in range(args.train_samples)]
    tasks = {int(n): [("held_out", int(n), d, f"{args.seed}:task:{n}:{d}:{j}") for d in depths
                      for j in range(args.per_depth)] for n in args.lengths.split(",") if n}
    setup = (args.processor, str(args.out), labels, split, args.distractors)
    with line_makers(args.jobs, initializer=_start, initargs=setup) as each:
        if jobs:
            with written_whole(args.out / "train.jsonl") as out:
                for i, line in enumerate(each(make_line, jobs)):
                    line.pop("answer")  # a training line: the reply is the answer
                    out.write(json.dumps(dict(line, id=f"train-{i}")) + "\n")
        for length, found in tasks.items():
            with written_whole(args.out / f"needle-{length}.jsonl") as out:
                for (_, _, depth, seed), line in zip(found, each(make_line, found)):
                    out.write(json.dumps(dict(line, id=f"needle-{length}-d{depth:.2f}-{seed.rsplit(':', 1)[1]}"))
                              + "\n")
    print(json.dumps({"out": str(args.out), "train_samples": args.train_samples, "lengths": args.lengths}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
