"""What wakes the daemon's loop: the signals it handles, its threads, and the sockets it reads.

`Wakeup(signals, fds)` installs a handler for each of `signals` that only records the signal (it is acted on in
the loop, never in the handler), points Python's signal wakeup fd at a socket pair whose write end (`writer`)
the daemon's threads may also write to, and `wait(timeout)` returns once any of that or one of `fds` is ready,
or the timeout passes. `close()` puts the previous handlers and wakeup fd back.
"""

from __future__ import annotations

import selectors
import signal
import socket
from collections.abc import Iterable
from types import FrameType


class Wakeup:
    def __init__(self, signals: Iterable[int], fds: Iterable[int]) -> None:
        self._reader, self.writer = socket.socketpair()
        self._reader.setblocking(False)
        self.writer.setblocking(False)
        self._caught: list[str] = []
        self._old_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in set(signals)}
        self._selector = selectors.DefaultSelector()
        for fd in (self._reader.fileno(), *fds):
            self._selector.register(fd, selectors.EVENT_READ)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._caught.append(signal.Signals(signum).name)

    def wait(self, timeout: float) -> None:
        self._selector.select(timeout)
        try:
            while self._reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def signals(self) -> list[str]:
        """The names of the signals caught since the last call, oldest first."""
        caught, self._caught = self._caught, []
        return caught

    def close(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._old_fd)
        self._selector.close()
        self._reader.close()
        self.writer.close()
