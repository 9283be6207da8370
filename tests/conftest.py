"""Shared fixtures: ``weft``, the command line run in this process (tests/weft_cli.py); a short
trained run to break (``trained_once``, ``trained``: tests/fault_runs.py)."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch

from fault_runs import train_fast
from weft_cli import run_weft

#: The test files that take longest on 2 cores (the durations CI prints), longest first. They
#: are collected first, and `make test` keeps that order (`--no-loadscope-reorder`; xdist would
#: otherwise start the files with the most tests first), so the workers of `-n 3 --dist
#: loadfile` take the long files first and end together, instead of one worker idling while the
#: other runs a long file it took last.
LONGEST_FIRST: tuple[str, ...] = (
    "test_digits.py", "test_faults.py", "test_fsdp_checkpoint.py", "test_check.py", "test_decode_compiled.py",
    "test_lora.py", "test_cli_run.py", "test_optimizer.py", "test_data_mix.py", "test_generate.py", "test_qlora.py",
    "test_eval_during_run.py", "test_sp_vl.py", "test_qwen3_vl.py",
)


def pytest_configure(config):
    """Under `-n N` the workers share the cores: each gets its share of intra-op threads, as weft's
    launcher gives its ranks (core/run/launch.py). torch's default (every core in every worker)
    left the two workers' OpenMP threads waiting on each other: the digits example's 250 steps
    took 96 s beside another file where they take ~20 s alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


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
