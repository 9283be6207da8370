"""Start N local ranks through torch's elastic launcher (what torchrun --standalone does)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import uuid

from weft.core.errors import EXIT_GUARD, EXIT_RUNTIME, EXIT_USER

#: The interpreter's flags of every process weft starts: the working folder is not on sys.path.
SAFE_PATH = ("-P",)


def launch_local(*, nproc: int, args: list[str], run_dir: pathlib.Path | None = None, max_restarts: int = 0) -> int:
    """Start ``nproc`` ranks running ``python args``; with ``max_restarts``, torch's elastic agent
    restarts all of them after a rank dies (the restarted ranks resume by themselves: see
    ``restarted``). A weft command (``-m weft ...``) is given this process's pid, so each rank
    ends when this process does (core/run/launcher_watch.py).

    Every rank's interpreter runs in safe-path mode (``python -P``, Python >= 3.11): ``-m`` would
    otherwise put the working folder first on ``sys.path``, and a ``pluggy.py``, ``torch.py`` or
    plugin ``.dist-info`` in a folder the user happens to run from would be imported in every
    rank (docs/faults.md, "Untrusted inputs"). So the ranks import exactly what ``weft plugins``
    lists."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # One thread per rank unless the user chose: N ranks on N cores must not oversubscribe.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if args[:2] == ["-m", "weft"]:
        args = [*args[:2], "--launcher-pid", str(os.getpid()), *args[2:]]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.2,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(*SAFE_PATH, *args)
    except ChildFailedError as error:
        codes = [failure.exitcode for failure in error.failures.values()]
        print(f"weft: {len(codes)} rank(s) failed with exit codes {sorted(set(codes))}", file=sys.stderr)
        worst = EXIT_USER if EXIT_USER in codes else EXIT_GUARD if EXIT_GUARD in codes else EXIT_RUNTIME
        return worst
    except SignalException as error:
        # Preemption: the launcher forwarded the signal to the ranks, which stopped after
        # their step and saved (summary.json says so), or were killed.
        status = _status(run_dir) if run_dir is not None else "no run directory"
        if status == "interrupted":
            return 0
        print(f"weft: stopped by {error.sigval.name}; the ranks did not finish saving (summary: {status})",
              file=sys.stderr)
        return 128 + int(error.sigval)
    return 0


def _status(run_dir: pathlib.Path) -> str:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status", "unknown")
    except (OSError, ValueError):
        return "none written"


def restarted() -> bool:
    """True in ranks the elastic agent started again after a failure (its own protocol:
    TORCHELASTIC_RESTART_COUNT counts the restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
