"""Shared fixtures: ``weft``, the command line run in this process (tests/weft_cli.py); a short
trained run to break (``trained_once``, ``trained``: tests/fault_runs.py)."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from fault_runs import train_fast
from weft_cli import run_weft


@pytest.fixture
def weft():
    """``weft(*args, cwd=None, env=None)`` -> Done(returncode, stdout, stderr), in this process;
    the ranks a command starts (check, eval, generate, run --nproc N) forked from the warm
    forkserver (tests/forked_ranks.py). A test about a process (signals, dead peers, the
    launcher and its restarts) keeps a ``python -m weft`` subprocess."""
    return run_weft


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory) -> pathlib.Path:
    """One 8-step run of tests/fault_runs.py's FAST recipe per test module, checkpoints at 2, 4, 6, 8."""
    return train_fast(tmp_path_factory.mktemp("trained"))


@pytest.fixture
def trained(trained_once, tmp_path) -> pathlib.Path:
    """A copy of ``trained_once``'s run directory (each test breaks its own)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_once, run_dir)
    return run_dir
