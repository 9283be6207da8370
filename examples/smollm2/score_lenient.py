"""Score reversal answers leniently: right when the reversed digits appear anywhere in the reply.

    python examples/smollm2/score_lenient.py RESULTS.jsonl [--json]

RESULTS.jsonl: ``weft eval --task data/held_out.jsonl --results RESULTS.jsonl`` (each line's
``prediction`` and ``answer``). ``weft eval --task`` scores exact match after normalisation; a
chatty model can know the answer and still fail that ("The reverse of 48213 is 31284."). This
scorer deletes every character of the reply that is not a digit and asks whether the answer is
in what is left: "3 1 2 8 4", "31,284" and a sentence around it all count. Before the training
it is still near 0%: the model fails the skill, not the format (README, examples/smollm2).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Sequence

from weft.core.train.task_file import wilson


def lenient_right(prediction: str, answer: str) -> bool:
    """The answer's digits, in order and adjacent, among the reply's digits (the rest deleted)."""
    return answer in "".join(ch for ch in prediction if ch.isdigit())


def score(rows: Sequence[dict]) -> dict:
    right = sum(lenient_right(r["prediction"], r["answer"]) for r in rows)
    exact = sum(bool(r["right"]) for r in rows)
    low, high = wilson(right, len(rows))
    return {"questions": len(rows), "exact": exact, "lenient": right, "lenient_accuracy": round(right / len(rows), 4),
            "lenient_interval_95": [round(low, 4), round(high, 4)]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=pathlib.Path, help="weft eval --results file of held_out.jsonl")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    if not rows or any("prediction" not in r or "answer" not in r for r in rows):
        parser.error(f"{args.results}: every line needs 'prediction' and 'answer' "
                     "(weft eval --task ... --results FILE)")
    result = score(rows)
    if args.json:
        print(json.dumps(result))
    else:
        low, high = result["lenient_interval_95"]
        print(f"{result['questions']} questions: {result['exact']} exactly right; {result['lenient']} with the "
              f"reversed digits anywhere in the reply ({result['lenient_accuracy']:.1%}, "
              f"95% interval {low:.1%}-{high:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
