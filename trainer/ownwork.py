"""`compute_s`, a heartbeat figure: a rank's own work in a step, without the time it waits for its peers
(docs/adopting.md, What a Session does: Heartbeats).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class OwnWork:
    """The `compute_s` figure: this rank's own work in a step, without waiting for its peers.

    In a job whose ranks synchronise every step, each rank's step lasts as long as the slowest
    rank's (the others wait for it in the gradient all-reduce), so `step_s` is the same on every
    rank and cannot tell which one is slow. The micro-batches before the last one synchronise
    nothing (`no_sync`): their time, scaled to the whole step, is this rank's own. Measured on the
    host's clock, or with CUDA events on a CUDA model (read once they have completed: no
    synchronisation); none with a single micro-batch per step."""

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self._start: Any = None
        self._done: list[tuple[Any, Any, float]] = []

    def mark(self, end: bool, scale: float) -> None:
        now: Any = time.monotonic()
        if self._cuda:
            now = torch.cuda.Event(enable_timing=True)
            now.record()
        if not end:
            self._start = now
        elif self._start is not None:
            self._done = [*self._done[-3:], (self._start, now, scale)]  # a few steps' events at most
            self._start = None

    def take(self) -> float | None:
        """The newest step's figure whose time is known, or None."""
        while self._done:
            start, end, scale = self._done[-1]
            if not self._cuda:
                self._done = []
                return (end - start) * scale
            if not end.query():
                return None
            self._done = []
            return start.elapsed_time(end) / 1000 * scale
        return None
