"""Failure containment: a piece of the auto-instrumentation that fails is turned off, with one warning, and the
training script goes on as if it had never been there."""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Piece:
    """One piece of the auto-instrumentation (the step beats, the collective timeout, the Trainer's callback, ...).
    `run` calls a function of it and never raises: the first exception turns the piece off for the rest of the
    process and is reported once, as a warning; every later `run` returns None at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.on = True
        self.error: BaseException | None = None

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        if not self.on:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # an adapter boundary: the script must never fail for its instrumentation
            self.fail(e)
            return None

    def after_init(self, cls: Any, adopt: Callable[..., object], *extra: Any) -> None:
        """Wrap `cls.__init__`: once it has returned, `adopt(the new object, *extra)` runs as a call of this piece."""
        original = cls.__init__

        @functools.wraps(original)
        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            original(obj, *args, **kwargs)
            self.run(adopt, obj, *extra)

        cls.__init__ = __init__

    def fail(self, error: BaseException) -> None:
        """Turn the piece off and say so once."""
        if not self.on:
            return
        self.on, self.error = False, error
        warn(f"{self.name} failed ({type(error).__name__}: {error}) and is off for this process; training goes on")


def warn(message: str) -> None:
    """A RuntimeWarning from the auto-instrumentation; to stderr when the script's filters make warnings errors."""
    text = f"ftsup auto-instrumentation: {message}"
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=3)
    except Exception:  # `-W error`: a warning must not become the script's exception
        try:
            print(f"warning: {text}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
