"""The terminal progress bar of `weft run` (rich), or nothing when not on a terminal."""

from __future__ import annotations


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, step: int, row: dict) -> None:
        pass


class _RichProgress(_NoProgress):
    """A rich bar with step, loss, tokens/s and memory."""

    def __init__(self, total: int, start: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        return False

    def advance(self, step: int, row: dict) -> None:
        memory = f" mem {row['max_memory_gib']:.1f} GiB" if "max_memory_gib" in row else ""
        self.progress.update(self.task, completed=step,
                             info=f"loss {row['loss']:.4f}  {row['tokens_per_s']:.0f} tok/s{memory}")


def progress_bar(enabled: bool, *, total: int, start: int):
    return _RichProgress(total, start) if enabled else _NoProgress()
