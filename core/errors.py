"""weft's own error types: a user error is a message with an exit code, never a traceback."""

from __future__ import annotations

#: Exit codes of every weft command: success (a run completed, or interrupted and saved), a
#: failure at run time, a user error, a guard that stopped the run.
EXIT_OK, EXIT_RUNTIME, EXIT_USER, EXIT_GUARD = 0, 1, 2, 3


class WeftError(Exception):
    """A problem the user can fix: bad recipe, bad flag, bad rule.

    The CLI prints ``str(error)`` as one paragraph and exits with ``exit_code``
    (2). ``where`` names the file and line or key the problem sits at, so every
    message starts with it.
    """

    exit_code = EXIT_USER

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class RecipeError(WeftError):
    """A recipe or rule file is malformed: unknown key, wrong type, bad value."""


class PlanError(WeftError):
    """The recipe is well-formed but cannot be carried out: mesh, heads, strategies."""


class HookError(WeftError):
    """A hook was called that no registered plugin answers."""

    exit_code = EXIT_RUNTIME


class RunFailed(WeftError):
    """A launched run or check failed at run time (the ranks' own output says why)."""

    exit_code = EXIT_RUNTIME


class GuardAbort(WeftError):
    """A guard stopped the run (non-finite loss, a loss spike, ...): not a user error."""

    exit_code = EXIT_GUARD


class PluginError(WeftError):
    """A plugin's hook raised: named with its hook and distribution, the traceback kept."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, *, where: str | None = None, plugin: str | None = None) -> None:
        super().__init__(message, where=where)
        self.plugin = plugin
