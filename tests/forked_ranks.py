"""The launcher of the in-process command line (tests/weft_cli.py): a command's ranks
(``check``, ``eval``, ``generate``, ``run --nproc N``) forked from the warm forkserver of
tests/distributed.py instead of fresh interpreters started by torch's elastic agent.

A fresh rank costs ~5 s of torch and transformers imports, and N of them share two cores;
a forked one starts in milliseconds. What a rank sees is what the elastic agent gives it:
``python -m weft --launcher-pid PID ARGS`` (here ``main(ARGS)``) with RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT and the agent's own store (TORCHELASTIC_USE_AGENT_STORE), one
thread per core, the caller's environment and working directory. The exit code is
``launch_local``'s. Not forked: restarts (``--max-restarts``) and signals, which are the
agent's own work; tests of those keep a ``python -m weft`` subprocess.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pathlib
import sys
import tempfile
import time

import distributed  # noqa: F401 - sets the forkserver's preload before the first fork

TIMEOUT_S = 600  # what the tests' subprocess.run calls allow a command
EXIT_TIMEOUT = 124  # a rank still running at the deadline: what timeout(1) exits with


def _rank(rank: int, *, nproc: int, env: dict, cwd: str, argv: list[str], logs: str, threads: int) -> None:
    """One rank, in a process forked from the forkserver: the caller's environment and folder
    (a fork inherits the server's), a test's plugin site on sys.path as PYTHONPATH would put
    it, stdout and stderr into files the launcher hands on to the caller's."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
                      ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    os.chdir(cwd)
    sys.path[:0] = [str(pathlib.Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for fd, name in ((1, "stdout"), (2, "stderr")):
        with open(os.path.join(logs, f"{rank}.{name}"), "wb") as file:
            os.dup2(file.fileno(), fd)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)
    import torch

    torch.set_num_threads(threads)  # imported by the server already: OMP_NUM_THREADS comes too late
    from weft.core.commands.main import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def launch_forked(*, nproc: int, args: list[str], run_dir: pathlib.Path | None = None, max_restarts: int = 0) -> int:
    """``launch_local``'s signature and exit codes (core/run/launch.py), the ranks forked."""
    import torch.distributed as dist

    from weft.core.errors import EXIT_GUARD, EXIT_RUNTIME, EXIT_USER

    if args[:2] != ["-m", "weft"] or max_restarts:
        raise AssertionError(f"forked ranks run weft commands without restarts, not {args} (max_restarts "
                             f"{max_restarts}): a test of the launcher starts a `python -m weft` subprocess")
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // nproc))
    # The agent's store: every rank connects to it as a client, as under torch's elastic agent.
    store = dist.TCPStore("127.0.0.1", 0, nproc, True, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
               TORCHELASTIC_RUN_ID=f"forked-{os.getpid()}-{time.monotonic_ns()}")
    argv = ["--launcher-pid", str(os.getpid()), *args[2:]]
    context = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as logs:
        ranks = [context.Process(target=_rank, args=(rank,), name=f"weft-rank-{rank}",
                                 kwargs=dict(nproc=nproc, env=env, cwd=os.getcwd(), argv=argv, logs=logs,
                                             threads=threads))
                 for rank in range(nproc)]
        for process in ranks:
            process.start()
        codes = _wait(ranks)
        _hand_on(logs, nproc=nproc)
    del store
    failed = [code for code in codes if code != 0]
    if not failed:
        return 0
    print(f"weft: {len(failed)} rank(s) failed with exit codes {sorted(set(failed))}", file=sys.stderr)
    return EXIT_USER if EXIT_USER in failed else EXIT_GUARD if EXIT_GUARD in failed else EXIT_RUNTIME


def _wait(ranks: list) -> list[int]:
    """Every rank's exit code. As the agent does, the first failure stops the others (they
    would wait for it in a collective) and counts alone; so does the deadline."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.is_alive() for p in ranks):
        failed = any(p.exitcode not in (None, 0) for p in ranks)
        if failed or time.monotonic() > deadline:
            codes = [p.exitcode if p.exitcode is not None else 0 for p in ranks]
            if not failed:
                codes = [EXIT_TIMEOUT if p.is_alive() else code for p, code in zip(ranks, codes)]
            for p in ranks:
                if p.is_alive():
                    p.kill()
                p.join()
            return codes
        time.sleep(0.05)
    return [p.exitcode for p in ranks]


def _hand_on(logs: str, *, nproc: int) -> None:
    """The ranks' output onto this process's stdout and stderr (where the elastic agent's
    ranks write: they inherit its descriptors), rank by rank."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        for rank in range(nproc):
            with contextlib.suppress(FileNotFoundError):
                stream.write(pathlib.Path(logs, f"{rank}.{name}").read_bytes().decode("utf-8", errors="replace"))
        stream.flush()


@contextlib.contextmanager
def forked_launcher():
    """weft's launcher replaced by ``launch_forked`` while the block runs."""
    from weft.core.run import launch

    real = launch.launch_local
    launch.launch_local = launch_forked
    try:
        yield
    finally:
        launch.launch_local = real
