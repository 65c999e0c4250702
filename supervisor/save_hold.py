"""Holding the durable tier's upload while the node's fast tier is being written: a training save in flight gets the
disk, the CPU and the memory bandwidth to itself.

A save in progress says so in the fast tier itself (`ftsup.store.saving`): its leader's `step-N.staging` marker
from the save call's start (the blocking copy to host memory), then its `step-N.partial/` directory until the commit
renames it; the supervisor reads that with no message from the ranks and no torch. An upload's pause hook
(`ftsup.store.durable.PauseHook`, called before each part is read and between the pieces of each part as it is sent)
is a `SaveHold`: while such a name is in the fast tier it waits, polling every POLL_S, and returns once the save is
committed (or torn and cleaned up). It never waits for ever: a name left by a crashed save (the next save removes
it) holds uploads for at most `max_hold_s` from when this hold first saw it, and one call waits at most
`max_hold_s` in all (saves back to back never starve the tier). `stop()` (the uploader closing) ends every wait
at once, and a caller's `give_up` (an urgent checkpoint waiting) ends its own within POLL_S. An emergency upload is
never held (the uploader passes no hook).

The fast tier is read with one `os.scandir` of its folder per POLL_S at most (shared by the upload's threads); a
folder that cannot be read holds nothing. `held_s` counts the wall-clock seconds during which any call waited
(the upload's threads held together count once), so that a measured upload throughput leaves them out.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ftsup.store import saving

POLL_S = 0.02
MAX_HOLD_S = 30.0


class SaveHold:
    def __init__(
        self, fast_tier: str | os.PathLike[str], *, max_hold_s: float = MAX_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if max_hold_s < 0:
            raise ValueError("max_hold_s must be at least 0")
        self.fast_tier = Path(fast_tier)
        self.max_hold_s = max_hold_s
        self.clock = clock
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._first_seen: dict[str, float] = {}  # a .partial entry -> when this hold first saw it
        self._checked = float("-inf")
        self._writing = False
        self._waiting = 0  # calls waiting now (the upload's threads)
        self._since = 0.0  # when the first of them began to wait
        self._held_s = 0.0

    def writing(self) -> bool:
        """Whether a save is in progress in the fast tier now (a marker or `.partial` seen for under `max_hold_s`)."""
        with self._lock:
            now = self.clock()
            if now - self._checked >= POLL_S:
                self._checked = now
                seen = saving.in_progress(self.fast_tier)
                self._first_seen = {name: self._first_seen.get(name, now) for name in seen}
                self._writing = any(now - t < self.max_hold_s for t in self._first_seen.values())
            return self._writing

    @property
    def held_s(self) -> float:
        """The seconds during which at least one call was waiting (wall time: threads held together count once)."""
        with self._lock:
            return self._held_s + (self.clock() - self._since if self._waiting else 0.0)

    def __call__(self, at_most_s: float = math.inf) -> None:
        self.wait(at_most_s)

    def wait(self, at_most_s: float = math.inf, give_up: Callable[[], bool] | None = None) -> None:
        """The pause hook: return once no save is in progress (at most `max_hold_s`, and `at_most_s`, from now), or
        at once when `give_up()` says so (checked every POLL_S)."""
        if self._stopped.is_set() or not self.writing():
            return
        start = self.clock()
        limit = min(self.max_hold_s, at_most_s)
        with self._lock:
            if not self._waiting:
                self._since = start
            self._waiting += 1
        try:
            while self.writing() and self.clock() - start < limit:
                if give_up is not None and give_up():
                    return
                if self._stopped.wait(POLL_S):  # a poll interval, not a fixed delay: the save ends the wait
                    return
        finally:
            with self._lock:
                self._waiting -= 1
                if not self._waiting:
                    self._held_s += self.clock() - self._since

    def stop(self) -> None:
        """End every wait now, and hold nothing from here on."""
        self._stopped.set()
