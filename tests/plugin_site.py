"""Install an in-repo test plugin for subprocesses: a package plus a .dist-info with an entry point."""

from __future__ import annotations

import os
import pathlib
import shutil

HERE = pathlib.Path(__file__).resolve().parent


def plugin_env(tmp: pathlib.Path, *, module: str, entry: str) -> dict:
    """Copy tests/<module>.py as a package into ``tmp/site`` with entry point ``entry`` in group
    ``weft``; return an environment whose PYTHONPATH finds it (real entry-point discovery)."""
    site = tmp / "site"
    package = site / module
    package.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / f"{module}.py", package / "__init__.py")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[weft]\n{entry} = {module}\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
