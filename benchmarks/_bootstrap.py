"""Make `import weft` work from a plain checkout (the GPU machine has no weft installed).

weft maps core/, strategies/, plugins/ and recipes/ into one package through
setuptools' package-dir; without an install, a temporary folder of symlinks
gives the same layout.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ensure_weft() -> None:
    if importlib.util.find_spec("weft") is not None:
        return
    target = pathlib.Path(tempfile.mkdtemp(prefix="weft-src-")) / "weft"
    target.mkdir()
    (target / "__init__.py").symlink_to(ROOT / "weft" / "__init__.py")
    for name in ("core", "strategies", "plugins", "recipes"):
        (target / name).symlink_to(ROOT / name)
    sys.path.insert(0, str(target.parent))
