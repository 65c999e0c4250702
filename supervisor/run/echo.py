"""The ranks' output on the supervisor's terminal: the attempt's log, as torchrun writes it (its own lines and each
rank's, prefixed `[rankN]: `), copied to stdout whole lines at a time (`logging.echo`).

The log file stays the record; how lines are kept from mixing: docs/design/run-loop.md, The ranks' output.
"""

from __future__ import annotations

import os
import select
import stat
import threading
from pathlib import Path

from ftsup.supervisor.telemetry.logs import OUTPUT_LOCK

POLL_S = 0.1  # how often the log is read for new lines
READ_BYTES = 1 << 20  # at most this much is copied per read
MAX_PARTIAL = 64 << 10  # a line longer than this is written without waiting for its end


def size_of(path: Path) -> int:
    """Where an attempt's output will begin in its log (appended to): the file's size now, 0 when there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


class Echo:
    """Copies what is appended to `path` after `offset` to the descriptor `out`, from a thread of its own, until
    `close()`, which copies what is left. Only whole lines are written, each batch under `OUTPUT_LOCK`, which the
    supervisor's own console lines take too. A log that is a link or not a regular file is not read; an `out` that
    is gone (a closed pipe, a terminal hung up) ends the echo, never the supervisor."""

    def __init__(self, path: Path, offset: int, *, out: int = 1, poll_s: float = POLL_S) -> None:
        self.path, self._offset, self._out, self._poll_s = path, offset, out, poll_s
        self._partial = b""
        self._fd: int | None = None
        self._done = threading.Event()
        self._broken = False
        self._thread = threading.Thread(target=self._run, name="ftsup-echo", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop following, once what the log holds now is copied (the attempt's processes are gone by then)."""
        self._done.set()
        self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _run(self) -> None:
        while True:
            last = self._done.is_set()  # read once more after close(): the lines written before it
            while self._copy() and not self._broken:
                pass
            if last or self._broken:
                if self._partial and not self._broken:
                    self._write(self._partial + b"\n")
                return
            self._done.wait(self._poll_s)

    def _copy(self) -> bool:
        """Copy the whole lines appended since the last call; whether the read was full (more may wait)."""
        fd = self._open()
        if fd is None:
            return False
        try:
            chunk = os.pread(fd, READ_BYTES, self._offset)
        except OSError:
            return False
        self._offset += len(chunk)
        data = self._partial + chunk
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) > MAX_PARTIAL:
            data, cut = data + b"\n", len(data) + 1
        self._partial = data[cut:]
        if cut:
            self._write(data[:cut])
        return len(chunk) == READ_BYTES

    def _open(self) -> int | None:
        if self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return None  # not there yet: torchrun is starting
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None
            self._fd = fd
        return self._fd

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        with OUTPUT_LOCK:
            while view:
                try:
                    view = view[os.write(self._out, view) :]
                except (InterruptedError, BlockingIOError):  # a non-blocking stdout that is full: wait for room
                    select.select([], [self._out], [], self._poll_s)
                except OSError:  # EPIPE, EIO, EBADF: no one reads the echo any more
                    self._broken = True
                    return
