"""What a long lease has done so far, in a few lines: the stages' progress, the runs' exit
codes, and every JSON result's figures (tokens and texts left out), for the device call that
watches ``benchmarks/lease_rows.sh`` (DEVELOPERS.md, "Work longer than one device call"):

    python3 benchmarks/lease_status.py /tmp/res
"""

from __future__ import annotations

import json
import pathlib
import sys

SKIP = {"tokens", "logprobs", "text", "answers", "tolerances"}


def main(folder: str) -> None:
    root = pathlib.Path(folder)
    for name in ("progress", "f8/status.txt", "rc"):
        path = root / name
        if path.is_file():
            print(f"== {name}\n{path.read_text().strip()}")
    for path in sorted(root.rglob("*.json")):
        try:
            result = json.loads(path.read_text())
        except ValueError:
            print(f"== {path.relative_to(root)}: not JSON yet (running, or failed: its .err)")
            continue
        if isinstance(result, dict):
            brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items() if k not in SKIP}
            print(f"== {path.relative_to(root)}: {json.dumps(brief)[:600]}")
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
