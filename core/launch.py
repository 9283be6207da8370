"""Start N local ranks through torch's elastic launcher (what torchrun --standalone does)."""

from __future__ import annotations

import os
import sys
import uuid

from weft.core.errors import EXIT_RUNTIME, EXIT_USER


def launch_local(*, nproc: int, args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # One thread per rank unless the user chose: N ranks on N cores must not oversubscribe.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as error:
        codes = [failure.exitcode for failure in error.failures.values()]
        print(f"weft: {len(codes)} rank(s) failed with exit codes {sorted(set(codes))}", file=sys.stderr)
        return EXIT_USER if EXIT_USER in codes else EXIT_RUNTIME
    return 0
