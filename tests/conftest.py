"""Shared fixtures: ``weft``, the command line run in this process (tests/weft_cli.py)."""

from __future__ import annotations

import pytest

from weft_cli import run_weft


@pytest.fixture
def weft():
    """``weft(*args, cwd=None, env=None)`` -> Done(returncode, stdout, stderr), in this process:
    for plan, report, export, plugins, check --world-size 1 and run --nproc 1. A command that
    starts ranks, or a test about a process, keeps a ``python -m weft`` subprocess."""
    return run_weft
