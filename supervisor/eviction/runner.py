"""Run watchers in daemon threads and hand what they see to the supervisor's loop (docs/design/eviction.md, The
threads).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ftsup.supervisor.eviction.notices import Blind, Notice, Seeing
from ftsup.supervisor.eviction.providers import WatchError

Report = Notice | Blind | Seeing


class Watcher(Protocol):
    name: str

    def poll(self, now_unix: float) -> Notice | None: ...

    def ack(self, notice: Notice) -> None: ...


class WatcherThreads:
    def __init__(
        self,
        watchers: Sequence[Watcher],
        poll_interval_s: float,
        wake: socket.socket | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.watchers = list(watchers)
        self.poll_interval_s = poll_interval_s
        self.reports: queue.Queue[Report] = queue.Queue()
        self._wake = wake
        self._clock = clock
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(w,), name=f"ftsup-watch-{w.name}", daemon=True)
            for w in self.watchers
        ]

    def start(self) -> WatcherThreads:
        for t in self._threads:
            t.start()
        return self

    def _put(self, report: Report) -> None:
        self.reports.put(report)
        if self._wake is not None:
            try:
                self._wake.send(b"w")
            except OSError:
                pass

    def _loop(self, w: Watcher) -> None:
        blind = False
        noticed = False
        while not self._stop.is_set():
            try:
                notice = w.poll(self._clock())
            except WatchError as e:
                if not blind:
                    self._put(Blind(w.name, str(e)))
                blind = True
            except Exception as e:  # adapter boundary: a watcher bug must not kill the daemon
                if not blind:
                    self._put(Blind(w.name, f"{type(e).__name__}: {e}"))
                blind = True
            else:
                if blind:
                    self._put(Seeing(w.name))
                blind = False
                if notice is not None and not noticed:
                    self._put(notice)
                    noticed = True
            self._stop.wait(self.poll_interval_s)

    def drain(self) -> list[Report]:
        out = []
        while True:
            try:
                out.append(self.reports.get_nowait())
            except queue.Empty:
                return out

    def ack(self, notice: Notice) -> None:
        for w in self.watchers:
            if w.name == notice.source:
                w.ack(notice)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
