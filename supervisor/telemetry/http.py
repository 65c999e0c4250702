"""The HTTP side of `/metrics`: one thread serving every connection, bounded so that the network cannot exhaust it.

It serves what `render(accept)` returns and knows nothing of the metrics (docs/design/telemetry.md, The endpoint).
"""

from __future__ import annotations

import gzip
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_CONNECTIONS = 32
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
RESPONSE_TIMEOUT_S = 10.0
LINGER_S = 1.0  # after answering, to let the client read before its unread input resets the connection
_MAX_DRAIN = 64 * 1024

Render = Callable[[str], tuple[bytes, str]]
"""accept header -> (body, content type)."""


def _ignore(reason: str) -> None:
    pass


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline: float
    peer: str
    inbuf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the response, once the request is in
    draining: int = 0  # bytes read and dropped after the response (closing with unread input resets it)
    done: bool = False  # answered; waiting for the client to close


def _response(
    status: str, body: bytes, ctype: str = "text/plain; charset=utf-8", *, head: bool = False, gzipped: bool = False
) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}", "Connection: close"]
    if gzipped:
        lines.append("Content-Encoding: gzip")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else body)


def _error(status: str, head: bool = False) -> bytes:
    return _response(status, f"{status}\n".encode(), head=head)


class BoundedHTTPServer:
    """Serve `render` on (host, port) from one thread until `close()`. Binding errors (a busy
    port, an address this host does not have) are raised by the constructor. A `render` that
    raises is answered 500 and reported to `on_error` (the reason); the endpoint goes on."""

    def __init__(
        self,
        host: str,
        port: int,
        render: Render,
        *,
        on_error: Callable[[str], None] = _ignore,
        max_connections: int = MAX_CONNECTIONS,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        response_timeout_s: float = RESPONSE_TIMEOUT_S,
    ) -> None:
        self._render = render
        self._on_error = on_error
        self.max_connections = max_connections
        self.max_request_bytes = max_request_bytes
        self.request_timeout_s = request_timeout_s
        self.response_timeout_s = response_timeout_s
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = found[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            # Lets a restarted supervisor bind over connections still in TIME_WAIT; Linux still
            # refuses a port that something listens on.
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(addr)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self.port = int(self._listener.getsockname()[1])
        self._conns: dict[int, _Conn] = {}  # by fd, in the order accepted
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stop = False
        self.dropped = 0  # connections closed for holding a slot too long or asking too much
        self._thread = threading.Thread(target=self._serve, name="ftsup-metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for conn in list(self._conns.values()):
            self._drop(conn, counted=False)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ the loop

    def _serve(self) -> None:
        while not self._stop:
            now = time.monotonic()
            soonest = min((c.deadline for c in self._conns.values()), default=now + 1.0)
            ready = self._sel.select(max(0.0, min(1.0, soonest - now)))
            # Connections first, then new ones: a request that has arrived is answered before
            # a burst of new connections can push its connection out.
            accept = False
            for key, mask in ready:
                if key.fileobj is self._wake_r:
                    return
                if key.fileobj is self._listener:
                    accept = True
                elif (conn := self._conns.get(key.fd)) is not None:
                    self._step(conn, mask)
            if accept:
                self._accept()
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline <= now]:
                self._drop(conn, counted=not conn.done)

    def _accept(self) -> None:
        # A few per pass, so that the connections already open get their turn in between.
        for _ in range(max(1, self.max_connections // 4)):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: leave it in the backlog for later
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                self._make_room()
            conn = _Conn(sock, time.monotonic() + self.request_timeout_s, peer[0])
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ)

    def _make_room(self) -> None:
        """Close one connection: an answered one, else the oldest still sending its request from
        the address that holds the most connections (a flood from one host pushes out its own
        connections, not a scraper's), else the oldest of all."""
        conns = list(self._conns.values())
        done = [c for c in conns if c.done]
        if done:
            self._drop(done[0], counted=False)
            return
        reading = [c for c in conns if c.out is None]
        if reading:
            per_peer = Counter(c.peer for c in reading)
            busiest = max(per_peer.values())
            victim = next(c for c in reading if per_peer[c.peer] == busiest)
        else:
            victim = conns[0]
        self._drop(victim)

    def _step(self, conn: _Conn, mask: int) -> None:
        try:
            if conn.done:
                data = conn.sock.recv(4096)
                conn.draining += len(data)
                if not data or conn.draining > _MAX_DRAIN:
                    self._drop(conn, counted=False)
            elif conn.out is None and mask & selectors.EVENT_READ:
                data = conn.sock.recv(4096)
                if not data:
                    self._drop(conn, counted=False)
                    return
                conn.inbuf += data
                end = conn.inbuf.find(b"\r\n\r\n")
                if end < 0 and len(conn.inbuf) <= self.max_request_bytes:
                    return
                if end < 0 or end + 4 > self.max_request_bytes:
                    self.dropped += 1
                    self._reply(conn, _error("431 Request Header Fields Too Large"))
                else:
                    self._reply(conn, self._answer(bytes(conn.inbuf[:end])))
            elif conn.out is not None and mask & selectors.EVENT_WRITE:
                self._send(conn)
        except OSError:  # reset by the peer, and the like: that connection only
            self._drop(conn, counted=False)

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _error("400 Bad Request")
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return _error("405 Method Not Allowed")
        is_head = method == "HEAD"
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return _error("404 Not Found", is_head)
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        try:
            body, ctype = self._render(headers.get("accept", ""))
        except Exception as e:  # adapter boundary: one failed scrape must not stop the endpoint
            self._on_error(f"{type(e).__name__}: {e}")
            return _error("500 Internal Server Error", is_head)
        gz = "gzip" in headers.get("accept-encoding", "")
        if gz:
            body = gzip.compress(body, compresslevel=1)
        return _response("200 OK", body, ctype, head=is_head, gzipped=gz)

    def _reply(self, conn: _Conn, response: bytes) -> None:
        conn.out = memoryview(response)
        conn.deadline = time.monotonic() + self.response_timeout_s
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        if conn.out is None:
            return
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        conn.out = conn.out[n:]
        if not conn.out:
            # Answered: half-close, then read and drop what the client still sends until it
            # closes (bounded in bytes and time), so that its unread input does not reset the
            # connection before it has read the answer.
            conn.done = True
            conn.deadline = time.monotonic() + LINGER_S
            conn.sock.shutdown(socket.SHUT_WR)
            self._sel.modify(conn.sock, selectors.EVENT_READ)

    def _drop(self, conn: _Conn, *, counted: bool = True) -> None:
        if counted:
            self.dropped += 1
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is not None:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.sock.close()
