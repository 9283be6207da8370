"""What a long lease has done so far, in a few lines: the stages' progress, the runs' exit
codes, and every JSON result's figures (tokens and texts left out), for the device call that
watches ``benchmarks/run_rows.sh lease`` (DEVELOPERS.md, "Work longer than one device call"):

    python3 benchmarks/lease_status.py /tmp/res
"""

from __future__ import annotations

import json
import pathlib
import sys

SKIP = {"tokens", "logprobs", "text", "answers", "tolerances"}
#: A run's own inputs and bookkeeping, not results: left out (they filled the call's 12,000
#: characters of output in 2026-12-02's lease, ahead of the figures).
INPUTS = {"plan.json", "recipe.json"}


def _brief(value):
    """A result without its long parts: floats rounded, lists of more than 20 (a curve's every
    step) as their length and last item, the SKIP keys left out, at any depth."""
    if isinstance(value, dict):
        return {k: _brief(v) for k, v in value.items() if k not in SKIP}
    if isinstance(value, list) and len(value) > 20:
        return {"n": len(value), "last": _brief(value[-1])}
    if isinstance(value, list):
        return [_brief(v) for v in value]
    return round(value, 3) if isinstance(value, float) else value


def main(folder: str) -> None:
    root = pathlib.Path(folder)
    for name in ("progress", "f8/status.txt", "rc"):
        path = root / name
        if path.is_file():
            print(f"== {name}\n{path.read_text().strip()}")
    for path in sorted(root.rglob("*.json")):
        if path.name in INPUTS:
            continue
        try:
            result = json.loads(path.read_text())
        except ValueError:
            print(f"== {path.relative_to(root)}: not JSON yet (running, or failed: its .err)")
            continue
        if isinstance(result, dict):
            print(f"== {path.relative_to(root)}: {json.dumps(_brief(result))[:600]}")
    for path in sorted(root.rglob("*.metrics.jsonl")):  # a training run's steps: the last two
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]
        for row in rows[-2:]:
            brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
            print(f"== {path.relative_to(root)}: {json.dumps(brief)[:400]}")
    for path in sorted(root.rglob("*.err")):
        lines = [line for line in path.read_text(errors="replace").splitlines()
                 if "Error" in line or "error:" in line]
        if lines:
            print(f"== {path.relative_to(root)}: {lines[-1][:300]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/res")
