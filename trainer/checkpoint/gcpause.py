"""Python's cyclic garbage collector, paused while a rank is inside a checkpoint's blocking part, since a collection
on one rank stalls every rank at the next collective (trainer/checkpoint/DESIGN.md, "The collector paused").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector disabled for the block (as it was left if it was already disabled)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
