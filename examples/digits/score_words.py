"""Count what the preference example's held-out answers are: words, numerals, the right digit.

    python examples/digits/score_words.py RESULTS.jsonl [--json]

RESULTS.jsonl: `weft eval --task data/held_out_prefer.jsonl --results RESULTS.jsonl` (each
line's ``prediction``, and the question's digit in ``meta``). A prediction is "in words" when it
is one of the ten English words, "a numeral" when it is one of the ten digits; "right" when, in
either form, it names the image's digit. Before the preference training the model answers in
numerals (~0% in words); after it, in words (examples/digits/prefer.toml).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Sequence

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def score(rows: Sequence[dict]) -> dict:
    """Shares of the answers in words, in numerals, naming the right digit (either form), and
    both (the right digit in words)."""
    n = len(rows)
    words = [r["prediction"].strip() in WORDS for r in rows]
    numerals = [r["prediction"].strip() in {str(d) for d in range(10)} for r in rows]
    right = [r["prediction"].strip() in (WORDS[r["meta"]["digit"]], str(r["meta"]["digit"])) for r in rows]
    return {"questions": n, "in_words": sum(words) / n, "numerals": sum(numerals) / n,
            "right_digit": sum(right) / n, "right_in_words": sum(w and r for w, r in zip(words, right)) / n}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=pathlib.Path, help="weft eval --results file of held_out_prefer.jsonl")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    if not rows or any("prediction" not in r or "digit" not in r.get("meta", {}) for r in rows):
        parser.error(f"{args.results}: every line needs 'prediction' and meta.digit (weft eval --task "
                     "data/held_out_prefer.jsonl --results FILE)")
    result = score(rows)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>15}: {value if key == 'questions' else f'{value:.1%}'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
