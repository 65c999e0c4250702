"""What wakes the daemon's loop: the signals it handles, its threads, and the sockets it reads.

A signal handler only records the signal (it is acted on in the loop); `close()` puts the previous handlers back.
"""

from __future__ import annotations

import contextlib
import selectors
import signal
import socket
from collections.abc import Iterable
from types import FrameType


class Wakeup:
    def __init__(self, signals: Iterable[int], fds: Iterable[int]) -> None:
        self._caught: list[str] = []
        with contextlib.ExitStack() as undo:
            self._reader, self.writer = socket.socketpair()
            undo.callback(self._reader.close)
            undo.callback(self.writer.close)
            self._reader.setblocking(False)
            self.writer.setblocking(False)
            old_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
            undo.callback(signal.set_wakeup_fd, old_fd)  # before the writer is closed: a signal then writes nowhere
            for s in set(signals):
                undo.callback(signal.signal, s, signal.signal(s, self._on_signal))
            self._selector = selectors.DefaultSelector()
            undo.callback(self._selector.close)
            for fd in (self._reader.fileno(), *fds):
                self._selector.register(fd, selectors.EVENT_READ)
            self._undo = undo.pop_all()

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
        self._undo.close()

    def __enter__(self) -> Wakeup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
