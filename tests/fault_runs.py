"""A one-rank run with checkpoints at steps 2, 4, 6, 8, and what breaking one takes: the fault
tests' shared material (tests/test_faults.py, tests/test_untrusted_inputs.py; the fixtures ``trained_once`` and
``trained`` in tests/conftest.py)."""

from __future__ import annotations

import json
import pathlib
import textwrap
import zlib

from weft_cli import run_weft

FAST = textwrap.dedent('''
    [model]
    preset = "qwen2_text_tiny"
    [data]
    source = "synthetic"
    tokens = 64
    num_samples = 64
    [train]
    max_steps = 8
    micro_batch_tokens = 64
    checkpoint_every = 2
    keep_checkpoints = 5
    lr = 1e-3
    warmup_steps = 1
    [parallel]
    nproc = 1
''')


def rows(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_fast(folder: pathlib.Path) -> pathlib.Path:
    """The FAST recipe trained in ``folder``: its run directory (checkpoints at 2, 4, 6, 8)."""
    (folder / "fast.toml").write_text(FAST)
    done = run_weft("run", str(folder / "fast.toml"), "--run-dir", str(folder / "run"), cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def rewrite_manifest_entry(checkpoint: pathlib.Path, name: str) -> None:
    """What someone planting a file would do: make the manifest agree with it."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class Planted:
    """Unpickling this touches a file: proof that code ran."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


