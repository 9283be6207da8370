"""Run-local structlog loggers: JSON lines into the run directory, a console view on a TTY.

No structlog.configure(): loggers are wrapped per run, so two runs in one
process (tests) never share state.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, TextIO

import structlog


class _Tee:
    """A structlog logger writing JSON to a file and, optionally, a console line.

    Events with ``file_only=True`` (a traceback, say) go to the file alone: the console
    gets one paragraph, the file everything."""

    def __init__(self, json_file: TextIO | None, console: TextIO | None, renderer: Any) -> None:
        self.json_file = json_file
        self.console = console
        self.renderer = renderer

    def msg(self, event_dict: dict) -> None:
        if self.json_file is not None:
            self.json_file.write(json.dumps(event_dict, default=str) + "\n")
            self.json_file.flush()
        if self.console is not None and not event_dict.get("file_only"):
            self.console.write(self.renderer(None, "", dict(event_dict)) + "\n")
            self.console.flush()

    info = warning = error = debug = critical = exception = msg


def _passthrough(logger: Any, method: str, event_dict: dict) -> Any:
    return ((event_dict,), {})


def run_logger(*, run_dir: pathlib.Path | None, rank: int, console: bool) -> structlog.BoundLogger:
    """Rank 0 writes ``log.jsonl``; other ranks ``logs/rank-N.jsonl``; console on rank 0 if asked."""
    json_file = None
    if run_dir is not None:
        path = run_dir / "log.jsonl" if rank == 0 else run_dir / "logs" / f"rank-{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        json_file = path.open("a", encoding="utf-8")
    renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    sink = _Tee(json_file, sys.stderr if console and rank == 0 else None, renderer)
    return structlog.wrap_logger(
        sink,
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _passthrough,
        ],
        context_class=dict,
        cache_logger_on_first_use=False,
    ).bind(rank=rank)
