"""Shared fixtures: ``weft``, the command line run in this process (tests/weft_cli.py)."""

from __future__ import annotations

import pytest

from weft_cli import run_weft


@pytest.fixture
def weft():
    """``weft(*args, cwd=None, env=None)`` -> Done(returncode, stdout, stderr), in this process;
    the ranks a command starts (check, eval, generate, run --nproc N) forked from the warm
    forkserver (tests/forked_ranks.py). A test about a process (signals, dead peers, the
    launcher and its restarts) keeps a ``python -m weft`` subprocess."""
    return run_weft
