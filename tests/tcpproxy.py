"""A TCP proxy on 127.0.0.1 for the tests, that cuts its connections when told: a network fault between a client and a
real server (the S3 store of `tests/s3server.py`), in the middle of whatever crosses.

`cut()` resets every connection open now (the client sees its request fail mid-transfer); `refusing = True` closes
each new one at once (the store unreachable) until set back; `truncate_after(n)`: the first connection to carry `n`
bytes to the server carries no more, the rest swallowed, so that the server answers a body that came short. Every
thread it starts is joined by `close()` (or the context manager).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType


class CuttingProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.refusing = False
        self.cuts = 0
        self.truncated = 0
        self._truncate_at: int | None = None
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def __enter__(self) -> CuttingProxy:
        self._acceptor.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def truncate_after(self, n: int) -> None:
        """The first connection to carry `n` bytes to the server from now on: the rest goes nowhere; counted in
        `truncated`."""
        self._truncate_at = n

    def cut(self) -> None:
        """Reset every connection open now (SO_LINGER 0: an RST, not a polite FIN); counted in `cuts`."""
        self.cuts += 1
        self._reset_all()

    def _reset_all(self) -> None:
        with self._lock:
            doomed, self._open = list(self._open), set()
        for s in doomed:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=10)
        self._reset_all()
        for t in self._threads:
            t.join(timeout=10)
        self.listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b, upward in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(a, b, upward), name="proxy-pump", daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool = False) -> None:
        carried = 0
        try:
            src.settimeout(None)
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                armed = self._truncate_at if upward else None
                if armed is not None and carried + len(data) >= armed:
                    with self._lock:
                        at, self._truncate_at = self._truncate_at, None
                    if at is not None:
                        dst.sendall(data[: at - carried])
                        dst.shutdown(socket.SHUT_WR)  # the server reads a body that ends short
                        self.truncated += 1
                        while src.recv(1 << 16):
                            pass  # the client sends the rest into nothing, then reads the server's answer
                        return
                carried += len(data)
                dst.sendall(data)
        except OSError:
            pass  # cut, or the other side closed
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
