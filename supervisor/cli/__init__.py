"""The `ftsup` command line; `main` is the console script."""

from __future__ import annotations

from ftsup.supervisor.cli.commands import main

__all__ = ["main"]
