"""``python -m weft``: the working folder is not an import location.

``python -m`` puts the current folder first on ``sys.path``: a ``pluggy.py``, ``torch.py`` or a
plugin's ``.dist-info`` in a folder someone unpacked would be imported in place of the real
ones. Dropped here, before anything but this package is imported, as ``python -P`` (the safe
path mode weft's launcher starts its ranks with, core/run/launch.py) drops it; a folder named in
PYTHONPATH stays, as the user chose it. ``weft`` (the console script) never has it.
"""

import os
import sys

if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from weft.core.commands.main import main  # noqa: E402 - after the path is safe

raise SystemExit(main())
