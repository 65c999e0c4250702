"""Holding the durable tier's upload while the node's fast tier is being written, so that a training save in flight
gets the disk, the CPU and the memory bandwidth to itself (docs/design/durable-uploads.md, Held while a save runs).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ftsup.store import saving

LOOK_S = 0.01  # the oldest look at the fast tier an upload goes on by (one scandir of a few names for all threads)
POLL_S = 0.05  # how often the watcher of a held upload looks again (the upload goes on at most this late)
MAX_HOLD_S = 30.0
_NAP_S = 1.0  # the longest a waiter that is not watching sleeps between looks at its own bound (a backstop)


class SaveHold:
    def __init__(
        self,
        fast_tier: str | os.PathLike[str],
        *,
        max_hold_s: float = MAX_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_hold_s < 0:
            raise ValueError("max_hold_s must be at least 0")
        self.fast_tier = Path(fast_tier)
        self.max_hold_s = max_hold_s
        self.clock = clock
        self._lock = threading.Lock()
        self._news = threading.Condition(self._lock)  # the watcher saw the save end, a caller give up, or left
        self._watching = False  # one waiting thread looks at the fast tier for all of them
        self._give_ups: dict[object, Callable[[], bool]] = {}  # each waiting call's give_up
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
            if now - self._checked >= LOOK_S:
                self._checked = now
                seen = saving.in_progress(self.fast_tier)
                self._first_seen = {name: self._first_seen.get(name, now) for name in seen}
            # Between looks at the folder too: a name seen for max_hold_s holds nothing from then on.
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
        key = object()
        with self._lock:
            if not self._waiting:
                self._since = start
            self._waiting += 1
            if give_up is not None:
                self._give_ups[key] = give_up
        try:
            self._held(start, limit, give_up)
        finally:
            with self._lock:
                self._give_ups.pop(key, None)
                self._waiting -= 1
                if not self._waiting:
                    self._held_s += self.clock() - self._since

    def _held(self, start: float, limit: float, give_up: Callable[[], bool] | None) -> None:
        """Sleep until the watcher has news, or watch for every waiter while no other thread does."""
        while True:
            left = limit - (self.clock() - start)
            if self._stopped.is_set() or left <= 0 or (give_up is not None and give_up()):
                return
            with self._lock:
                if not self._writing:
                    return
                if self._watching:
                    self._news.wait(min(left, _NAP_S))
                    continue
                self._watching = True
            try:
                self._watch(start, limit, give_up)
                return
            finally:
                with self._lock:
                    self._watching = False
                    self._news.notify_all()  # the save's end, or another waiter takes the watch over

    def _watch(self, start: float, limit: float, give_up: Callable[[], bool] | None) -> None:
        """Look at the fast tier every POLL_S until the save is over, this call gives up or its time is up; wake the
        other waiters when one of them gives up."""
        while True:
            left = limit - (self.clock() - start)
            if left <= 0 or self._stopped.wait(min(left, POLL_S)):  # a poll interval: the save ends the wait
                return
            if not self.writing() or (give_up is not None and give_up()):
                return
            with self._lock:
                others = list(self._give_ups.values())
            if any(g() for g in others):
                with self._lock:
                    self._news.notify_all()

    def stop(self) -> None:
        """End every wait now, and hold nothing from here on."""
        self._stopped.set()
        with self._lock:
            self._news.notify_all()
