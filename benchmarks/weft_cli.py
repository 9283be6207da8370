"""The weft CLI from a plain checkout (the GPU machine has no weft installed).

    python3 benchmarks/weft_cli.py run benchmarks/attention/ring_model.toml --run-dir /tmp/ring
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

from weft.core.commands.main import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
