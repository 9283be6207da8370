"""A user error met on the ranks, said once by the process that started them.

Every rank that meets a WeftError notes its message in a file of its own before it exits;
the launcher, once the ranks have ended, says the lowest rank's note. Rank 0 alone printing
lost the message whenever another rank failed first and the launcher stopped rank 0 before
it printed (all ranks meet the same plan error at once; seen 1 run in 4).
"""

from __future__ import annotations

import pathlib

from weft.core.errors import WeftError


def note(error: WeftError, *, folder: pathlib.Path, stem: str, rank: int) -> None:
    """``error``'s message in ``folder/<stem>.rank<rank>.error``; the error marked noted (the
    rank then leaves the saying to its launcher: core/commands/main.py)."""
    (folder / f"{stem}.rank{rank}.error").write_text(str(error))
    error.noted = True


def clear(*, folder: pathlib.Path, stem: str) -> None:
    """An earlier launch's notes gone (a run directory used again)."""
    for path in folder.glob(f"{stem}.rank*.error"):
        path.unlink(missing_ok=True)


def noted(*, folder: pathlib.Path, stem: str, code: int) -> WeftError | None:
    """The lowest rank's noted error with the ranks' exit ``code`` (the launcher's: a user's 2
    or a guard's where any rank ended so, else a run's failure; a peer's death noted by the
    survivor stays 1, not a user's 2); None when no rank noted one."""
    notes = sorted(folder.glob(f"{stem}.rank*.error"), key=lambda p: int(p.name.rsplit("rank", 1)[1][:-6]))
    if not notes:
        return None
    error = WeftError(notes[0].read_text())
    error.exit_code = code
    return error
