"""The supervisor's exception tree: every error a user can meet says what to do about it.

The exit status of `ftsup` follows the class (see `ftsup.supervisor.cli.main`): `ConfigError` and `UsageError` are 2
(refused before anything started), `RunError` is 1 (`ftsup run` accepted its config, then failed).
"""

from __future__ import annotations

from ftsup.store.errors import os_error_line


class SupervisorError(Exception):
    """Base of every error raised by `supervisor`."""


class UsageError(SupervisorError):
    """The command line asks for something that cannot be done as given (exit status 2)."""


class ConfigError(SupervisorError):
    """The job config cannot be used as written (exit status 2); the one-line message names the key path and the fix."""


class RunError(SupervisorError):
    """`ftsup run` accepted its config, then could not start or carry on (exit status 1, which a service manager
    restarts): an I/O error while it set up, or an internal error (its traceback is in the supervisor's log)."""


def error_line(error: BaseException) -> str:
    """An exception as one line for a message: for an OSError the path and what went wrong, in words
    (`ftsup.store.errors.os_error_line`: errno numbers are noise to the person who has to act), else its type and
    text."""
    if isinstance(error, OSError):
        return os_error_line(error)
    return f"{type(error).__name__}: {error}"
