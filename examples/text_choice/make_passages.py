"""Write a held-out multiple-choice task over Python's own standard library: how does this
line go on?

    python examples/text_choice/make_passages.py OUT.jsonl [--questions 300] [--seed 0]

Each question is a passage from a file the recipe (text_choice.toml) never trains on — it
trains on the top-level modules, ``<stdlib>/*.py``; the passages come from packages,
``<stdlib>/PACKAGE/*.py`` — cut inside a line just after a space, ``.``, ``(``, ``=`` or
``,``, and four candidates for the rest of that line (at most 24 characters): the true one
and three line tails from other held-out files, cut the same way. A line is one JSON object
(docs/inference.md, plain-text questions):

    {"id": "json/decoder.py:120", "context": "...\\n        end = ", "choices": ["_w(s, end).end()", ...],
     "answer": 2}

Scored by ``weft eval --task`` as lm-evaluation-harness scores multiple choice: each choice's
summed log-likelihood as the continuation of the context (and per byte: ``accuracy_norm``).
Guessing gets 25%. Whole next lines were tried first and left a small model at chance: a
line's own likelihood varies far more from line to line than the passage moves it, while a
line's tail depends on its head. Nothing is downloaded: the text is the running Python's own.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
from collections.abc import Sequence

from weft.strategies.data.text_corpus import corpus_files

#: Packages the recipe's training glob (<stdlib>/*.py) does not reach.
HELD_OUT = ("asyncio", "email", "http", "json", "logging", "urllib", "importlib", "unittest", "xml/dom", "wsgiref",
            "html", "multiprocessing", "concurrent/futures", "xmlrpc", "tomllib", "zoneinfo")
PASSAGE_LINES = 8      # whole lines before the cut line
CHOICES = 4
TAIL_CHARS = 24        # a choice: the rest of the line, at most this long
CUT_AFTER = " .(=,"    # a cut falls after one of these, before a character that is not a space
MIN_LINE = 16          # a cut line holds at least this many characters past its indentation


def cuts(lines: Sequence[str]) -> list[tuple[int, int]]:
    """(line, column) of every cut: past the indentation and 4 characters, 8 or more left."""
    found = []
    for number, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if number < PASSAGE_LINES or len(line) - indent < MIN_LINE:
            continue
        found.extend((number, col) for col in range(indent + 4, len(line) - 8)
                     if line[col - 1] in CUT_AFTER and line[col] != " ")
    return found


def questions(files: Sequence[pathlib.Path], *, count: int, seed: int, root: pathlib.Path) -> list[dict]:
    """``count`` questions, each at a random cut of a random file of ``files``; distractors are
    other files' line tails at their cuts."""
    rng = random.Random(seed)
    texts = {f: f.read_text(encoding="utf-8", errors="replace").splitlines() for f in files}
    spots = {f: cuts(lines) for f, lines in texts.items()}
    files = [f for f in files if spots[f]]

    def tail(file: pathlib.Path, at: tuple[int, int]) -> str:
        return texts[file][at[0]][at[1]:at[1] + TAIL_CHARS]

    found: list[dict] = []
    seen: set[tuple[pathlib.Path, tuple[int, int]]] = set()
    while len(found) < count:
        file = rng.choice(files)
        at = rng.choice(spots[file])
        if (file, at) in seen:
            continue
        seen.add((file, at))
        truth, (row, col) = tail(file, at), at
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            other = rng.choice(files)
            text = tail(other, rng.choice(spots[other])) if other != file else truth
            if text != truth and text not in distractors:
                distractors.append(text)
        choices = [truth, *distractors]
        rng.shuffle(choices)
        context = "\n".join(texts[file][row - PASSAGE_LINES:row]) + "\n" + texts[file][row][:col]
        found.append({"id": f"{file.relative_to(root).as_posix()}:{row + 1}:{col + 1}", "context": context,
                      "choices": choices, "answer": choices.index(truth)})
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the task file to write (JSONL)")
    parser.add_argument("--questions", type=int, default=300, help="how many (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the files, cuts and distractors (default 0)")
    args = parser.parse_args(argv)
    files = [f for package in HELD_OUT for f in corpus_files(f"<stdlib>/{package}/*.py", base=pathlib.Path("."))]
    if len(files) < CHOICES:
        parser.error(f"only {len(files)} held-out files found under the standard library")
    root = corpus_files("<stdlib>/json/__init__.py", base=pathlib.Path("."))[0].parents[1]  # the stdlib's folder
    lines = questions(files, count=args.questions, seed=args.seed, root=root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    print(f"{len(lines)} questions from {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
