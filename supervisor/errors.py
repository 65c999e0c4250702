"""The supervisor's exception tree: every error a user can meet says what to do about it."""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of every error raised by `supervisor`."""


class UsageError(SupervisorError):
    """The command line asks for something that cannot be done as given (exit status 2)."""


class ConfigError(SupervisorError):
    """The job config cannot be used as written (exit status 2); the one-line message names the key path and the fix."""
