"""The command line run in this process (no interpreter start, no torch import): ``run_weft``,
and the ``weft`` fixture (tests/conftest.py) that gives it, for the commands that run in one process.

Use it for every command whose process is not what the test is about. A command that starts
ranks (``check``, ``eval``, ``generate``, ``run --nproc 2+``) gets them forked from the warm
forkserver (tests/forked_ranks.py), not from torch's elastic agent. A test about a process
(exit on a signal, dead or stopped peers, the launcher and its restarts, torchrun, what the
real launcher hands its ranks) keeps a real ``python -m weft`` subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import random
import signal
import sys
import tempfile
import traceback
import warnings

# Every handler a command may install (core/run/interrupt.py, torch's elastic agent).
_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
                        signal.SIGQUIT, signal.SIGALRM, signal.SIGCHLD, signal.SIGPIPE)]


@dataclasses.dataclass
class Done:
    """What ``subprocess.run(..., capture_output=True, text=True)`` gives: the same names."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class _Restored:
    """Everything a command may change in this process, put back as it was."""

    def __init__(self) -> None:
        import structlog
        import torch

        self.cwd = os.getcwd()
        self.environ = dict(os.environ)
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.modules = set(sys.modules)
        self.handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.rng = torch.get_rng_state()
        self.random = random.getstate()
        self.structlog = structlog.get_config()
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()

    def restore(self, *, added_paths: list[str]) -> None:
        import structlog
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from weft.core.run.process_group import close_process_group

            close_process_group(clean=False)
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.environ)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        for name in set(sys.modules) - self.modules:  # a test's plugin site, imported from PYTHONPATH
            file = getattr(sys.modules[name], "__file__", None) or ""
            if any(file.startswith(p) for p in added_paths):
                del sys.modules[name]
        for sig, handler in self.handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng)
        random.setstate(self.random)
        structlog.configure(**self.structlog)
        self.warnings.__exit__(None, None, None)


@contextlib.contextmanager
def _captured():
    """stdout and stderr at the file descriptors (what child processes print too) and at
    sys.stdout/sys.stderr; yields a dict that holds "stdout" and "stderr" afterwards."""
    got: dict[str, str] = {}
    files = {name: tempfile.TemporaryFile(mode="w+b") for name in ("stdout", "stderr")}
    saved_fds, saved_sys = {}, {}
    for fd, name in ((1, "stdout"), (2, "stderr")):
        getattr(sys, name).flush()
        saved_fds[fd] = os.dup(fd)
        os.dup2(files[name].fileno(), fd)
        saved_sys[name] = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(open(os.dup(fd), "wb", buffering=0), encoding="utf-8",
                                            errors="replace", write_through=True))
    try:
        yield got
    finally:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = getattr(sys, name)
            stream.flush()
            setattr(sys, name, saved_sys[name])
            stream.close()
            os.dup2(saved_fds[fd], fd)
            os.close(saved_fds[fd])
            files[name].seek(0)
            got[name] = files[name].read().decode("utf-8", errors="replace")
            files[name].close()


def run_weft(*args: str | os.PathLike, cwd: str | os.PathLike | None = None, env: dict | None = None,
             timeout: float | None = None) -> Done:
    """``weft ARGS`` in this process -> Done(returncode, stdout, stderr); everything the command
    changed in the process put back. ``env`` replaces the environment for the command (as
    subprocess.run's would); its PYTHONPATH entries go on sys.path for it (a test's plugin
    site). ``timeout`` is accepted for subprocess.run's signature and not enforced."""
    from forked_ranks import forked_launcher
    from weft.core.commands.main import main

    argv = [str(a) for a in args]
    saved = _Restored()
    added: list[str] = []
    code: object = 1
    with _captured() as output:
        try:
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
                added = [str(pathlib.Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
                sys.path[:0] = added
            if cwd is not None:
                os.chdir(cwd)
            sys.argv[:] = ["weft", *argv]
            try:
                with forked_launcher():
                    code = main(argv)
            except SystemExit as stop:  # argparse's usage errors, --help
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)
            except Exception:  # as `python -m weft` would end: the traceback, exit code 1
                traceback.print_exc()
                code = 1
        finally:
            saved.restore(added_paths=added)
    return Done(args=["weft", *argv], returncode=int(code or 0), stdout=output["stdout"], stderr=output["stderr"])
