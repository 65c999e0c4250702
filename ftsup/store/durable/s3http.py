"""The S3 client's HTTP: every request of a durable tier sent, and every answer read, here, capped in bytes and
bounded in time (per request and by the tier's operation deadline).

botocore builds, signs, retries and parses; this module is its `before-send` handler (ftsup/store/DESIGN.md,
"Hostile answers").
"""

from __future__ import annotations

import base64
import http.client
import io
import math
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.awsrequest import AWSResponse
from botocore.exceptions import (
    BotoCoreError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from botocore.httpsession import get_cert_path
from botocore.utils import get_environ_proxies

ANSWER_MAX_BYTES = 4 << 20
"""The largest answer read that is not an object's bytes: a listing's page (1,000 names), an upload's answers."""
ERROR_MAX_BYTES = 64 << 10
"""The largest error document read (S3's are a few hundred bytes)."""
PIECE_BYTES = 1 << 20
"""What one read from a connection takes at most: an answer is never allocated at the size it claims."""
SEND_PIECE_BYTES = 256 << 10
"""What one send takes at most: a store that takes a body slowly is cut at the request's deadline."""
_RANGE = "bytes="


class AnswerTooLarge(BotoCoreError):
    """An answer ran past its cap: what the store sends is never read further (not retried)."""

    fmt = "the answer of {endpoint} to {operation} ran past its cap of {cap} bytes; refusing it"


class DeadlinePassed(BotoCoreError):
    """The tier's operation deadline passed while a request was made or read (not retried)."""

    fmt = "{endpoint} gave no whole answer to {operation} by its operation's deadline ({seconds:g}s)"


class RequestTimedOut(ReadTimeoutError):
    """One request ran past `request_timeout_s` (a store answering a byte at a time); retried as a timeout is."""

    fmt = 'Read timeout on endpoint URL: "{endpoint_url}": {operation} took longer than {seconds:g}s'


@dataclass(frozen=True)
class Limits:
    """How long a request may take: `connect_s` to connect, `idle_s` between two bytes, `request_s` in all (from
    the connection to the answer's last byte); `ends_at()` is the tier's operation deadline (monotonic; None: none),
    `budget_s()` how long that operation was given (for the error)."""

    connect_s: float
    idle_s: float
    request_s: float
    pool: int
    ends_at: Callable[[], float | None]
    budget_s: Callable[[], float]


class Transport:
    """The HTTP connections of one S3 client (a pool per endpoint) and its `before-send` handler (`send`)."""

    def __init__(self, limits: Limits, ca_bundle: str | None = None) -> None:
        self.limits = limits
        self._ca = ca_bundle
        self._tls: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int, str], list[_Connection]] = {}
        self._proxies: dict[str, str] = {}  # netloc -> the proxy the environment names for it ("": none)
        self._closed = False

    def install(self, client: Any) -> None:
        """Send every request of the S3 client `client` through this transport."""
        client.meta.events.register("before-send.s3", self.send)

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, {}, True
        for conns in idle.values():
            for conn in conns:
                conn.close()

    # ------------------------------------------------------------------ the handler

    def send(self, request: Any, event_name: str = "", **_: Any) -> AWSResponse:
        """botocore's `before-send` handler: `request` (signed) sent, its answer's head read; the body read whole
        (at most its cap) unless the operation streams it (a GET: at most the range asked for and one byte)."""
        operation = event_name.rpartition(".")[2] or "a request"
        url = urllib.parse.urlsplit(request.url)
        clock = _Clock(self.limits, f"{url.scheme}://{url.netloc}", operation)
        conn = self._take(url, fresh=False)
        try:
            response = self._exchange(conn, request, url, clock)
        except _Stale:  # a pooled connection the store had closed meanwhile: once more, on a new one
            request.reset_stream()
            conn = self._take(url, fresh=True)
            response = self._exchange(conn, request, url, clock)
        headers = _headers(response)
        if response.status >= 300 or not request.stream_output:
            cap = ERROR_MAX_BYTES if response.status >= 300 else ANSWER_MAX_BYTES
            body = _Body(self, conn, response, cap, clock)
            try:
                whole = body.read()
            finally:
                body.close()
            return AWSResponse(request.url, response.status, headers, _Whole(whole))
        return AWSResponse(request.url, response.status, headers, _Body(self, conn, response, _cap_of(request), clock))

    def _exchange(self, conn: _Connection, request: Any, url: urllib.parse.SplitResult, clock: _Clock) -> Any:
        """Send `request` on `conn` and read its answer's head; on any failure `conn` is closed."""
        target = request.url if conn.via_proxy else (url.path or "/") + (f"?{url.query}" if url.query else "")
        try:
            conn.ends = clock.ends
            conn.timeout = clock.left(self.limits.connect_s)
            conn.putrequest(request.method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in request.headers.items():
                if name.lower() != "expect":  # the body goes at once: a store's early refusal arrives as its answer
                    conn.putheader(name, value)
            if "host" not in {k.lower() for k in request.headers}:
                conn.putheader("Host", _host(url))
            conn.endheaders()
            _send_body(conn, request.body)
            return conn.getresponse()
        except BaseException as e:
            conn.close()
            if isinstance(e, BotoCoreError):
                raise
            if isinstance(e, TimeoutError):
                raise clock.timed_out(connected=conn.bounded is not None) from None
            stale = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
            if conn.pooled and isinstance(e, stale):
                raise _Stale() from None
            if isinstance(e, (OSError, http.client.HTTPException)):
                if conn.bounded is None:
                    raise EndpointConnectionError(endpoint_url=clock.endpoint, error=e) from None
                raise ConnectionClosedError(endpoint_url=clock.endpoint, error=e) from None
            raise

    # ------------------------------------------------------------------ the pool

    def _take(self, url: urllib.parse.SplitResult, *, fresh: bool) -> _Connection:
        scheme = url.scheme.lower()
        host, port = url.hostname or "", url.port or (443 if scheme == "https" else 80)
        proxy = self._proxies.get(url.netloc)
        if proxy is None:
            proxy = self._proxies[url.netloc] = get_environ_proxies(url.geturl()).get(scheme, "")
        key = (scheme, host, port, proxy)
        with self._lock:
            idle = self._idle.get(key, [])
            if idle and not fresh:
                conn = idle.pop()
                conn.pooled = True
                return conn
        return self._connect(key)

    def _connect(self, key: tuple[str, str, int, str]) -> _Connection:
        scheme, host, port, proxy = key
        at = urllib.parse.urlsplit(proxy) if proxy else None
        where = (at.hostname or "", at.port or 8080) if at is not None else (host, port)
        conn: _Connection
        if scheme == "https":
            conn = _TLSConnection(where[0], where[1], context=self._context())
            if at is not None:
                conn.set_tunnel(host, port, headers=_proxy_auth(at))
            conn.via_proxy, conn.proxy_headers = False, {}
        else:
            conn = _PlainConnection(where[0], where[1])
            conn.via_proxy = at is not None
            conn.proxy_headers = _proxy_auth(at) if at is not None else {}
        conn.key, conn.idle_s, conn.pooled, conn.ends = key, self.limits.idle_s, False, math.inf
        return conn

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=self._ca or get_cert_path(True))
        return self._tls

    def give_back(self, conn: _Connection, response: Any) -> None:
        """`conn` once `response` was read to its end: kept for the next request, or closed."""
        if response.will_close or not response.isclosed():
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(conn.key, [])
            if not self._closed and len(idle) < self.limits.pool:
                idle.append(conn)
                return
        conn.close()


class _Stale(Exception):
    """A connection taken from the pool was closed by the store before it answered."""


class _Clock:
    """One request's deadlines: its own (`request_s` from now) and its operation's, whichever comes first."""

    def __init__(self, limits: Limits, endpoint: str, operation: str) -> None:
        self.limits, self.endpoint, self.operation = limits, endpoint, operation
        now = time.monotonic()
        self.operation_ends = limits.ends_at()
        self.request_ends = now + limits.request_s
        if self.operation_ends is not None and now >= self.operation_ends:
            raise self.timed_out(connected=False)
        self.ends = min(self.request_ends, self.operation_ends or math.inf)

    def left(self, at_most: float) -> float:
        left = self.ends - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        return min(left, at_most)

    def timed_out(self, *, connected: bool) -> BotoCoreError:
        now = time.monotonic()
        if self.operation_ends is not None and now >= self.operation_ends - 0.001:
            return DeadlinePassed(endpoint=self.endpoint, operation=self.operation, seconds=self.limits.budget_s())
        if now >= self.request_ends - 0.001:
            return RequestTimedOut(endpoint_url=self.endpoint, operation=self.operation, seconds=self.limits.request_s)
        if not connected:
            return ConnectTimeoutError(endpoint_url=self.endpoint)
        return ReadTimeoutError(endpoint_url=self.endpoint)


class _Bounded:
    """A connected socket whose every send and receive ends by its connection's `ends` (monotonic), each waiting at
    most `idle_s`: a store that sends or takes a byte at a time is cut at the deadline, wherever the reader is (a
    status line, a header, a chunk's size, the body)."""

    def __init__(self, sock: socket.socket, conn: _Pooled) -> None:
        self.sock = sock
        self._conn = conn
        self._files = 0
        self._closing = False

    def _arm(self) -> None:
        left = self._conn.ends - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        self.sock.settimeout(min(left, self._conn.idle_s))

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), SEND_PIECE_BYTES):
            self._arm()
            self.sock.sendall(view[at : at + SEND_PIECE_BYTES])

    def recv_into(self, buffer: Any) -> int:
        self._arm()
        return self.sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        self._files += 1
        return io.BufferedReader(_Receiver(self), 64 << 10)

    def file_closed(self) -> None:
        self._files -= 1
        if self._closing and self._files <= 0:
            self.sock.close()

    def close(self) -> None:  # as a socket's: the reader of an answer still open keeps it
        self._closing = True
        if self._files <= 0:
            self.sock.close()


class _Receiver(io.RawIOBase):
    def __init__(self, owner: _Bounded) -> None:
        self._owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._owner.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._owner.file_closed()
        super().close()


class _Pooled(http.client.HTTPConnection):
    """A connection of the pool: its key, whether it was taken from the pool (`pooled`), its proxy's headers;
    connected, its socket is `_Bounded`."""

    key: tuple[str, str, int, str]
    idle_s: float
    pooled: bool
    ends: float
    """When the request in progress must be answered (monotonic): every send and receive ends by then."""
    via_proxy: bool
    proxy_headers: dict[str, str]
    bounded: _Bounded | None = None

    def _bound(self) -> None:
        self.bounded = _Bounded(self.sock, self)  # type: ignore[arg-type]
        self.sock = self.bounded  # type: ignore[assignment]

    def putrequest(self, method: str, url: str, skip_host: bool = False, skip_accept_encoding: bool = False) -> None:
        super().putrequest(method, url, skip_host=skip_host, skip_accept_encoding=skip_accept_encoding)
        for name, value in self.proxy_headers.items():
            self.putheader(name, value)


class _PlainConnection(_Pooled):
    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self._bound()


class _TLSConnection(_Pooled, http.client.HTTPSConnection):
    def connect(self) -> None:
        http.client.HTTPSConnection.connect(self)
        self._bound()


_Connection = _Pooled


class _Body:
    """An answer's body as botocore reads it (`read`, `stream`, `close`): at most `cap` bytes, in pieces of at
    most PIECE_BYTES, each by the request's deadlines; read to its end, the connection goes back to the pool."""

    def __init__(self, transport: Transport, conn: _Connection, response: Any, cap: int, clock: _Clock) -> None:
        self._transport, self._conn, self._response = transport, conn, response
        self._cap, self._clock = cap, clock
        self._got = 0
        self._done = False

    def read(self, amt: int | None = None) -> bytes:
        """Up to `amt` bytes (None: to the end), fewer only at the end; past the cap, AnswerTooLarge."""
        want = self._cap + 1 - self._got if amt is None else amt
        pieces: list[bytes] = []
        while want > 0 and not self._done:
            room = self._cap - self._got
            if room <= 0:
                if self._piece(1):
                    raise AnswerTooLarge(endpoint=self._clock.endpoint, operation=self._clock.operation, cap=self._cap)
                break
            data = self._piece(min(want, room, PIECE_BYTES))
            if not data:
                break
            pieces.append(data)
            self._got += len(data)
            want -= len(data)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _piece(self, n: int) -> bytes:
        try:
            data = self._response.read(n)
        except TimeoutError:
            self.close()
            raise self._clock.timed_out(connected=True) from None
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise ConnectionClosedError(endpoint_url=self._clock.endpoint, error=e) from None
        if not data:
            short = self._response.length  # what its Content-Length still promised
            if short:
                self.close()
                error = http.client.IncompleteRead(b"", short)
                raise ConnectionClosedError(endpoint_url=self._clock.endpoint, error=error)
            self._finish()
        return bytes(data)

    def stream(self, amt: int = PIECE_BYTES) -> Any:
        while True:
            data = self.read(amt)
            if not data:
                return
            yield data

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._transport.give_back(self._conn, self._response)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._response.close()
            self._conn.close()


class _Whole:
    """An answer read whole, as botocore's `AWSResponse.content` takes it."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Any:
        yield self._data

    def read(self, amt: int | None = None) -> bytes:
        data, self._data = (self._data, b"") if amt is None else (self._data[:amt], self._data[amt:])
        return data

    def close(self) -> None:
        self._data = b""


def _send_body(conn: _Connection, body: Any) -> None:
    if body is None:
        return
    if isinstance(body, (bytes, bytearray, memoryview)):
        if len(body):
            conn.send(body)
        return
    if isinstance(body, str):
        conn.send(body.encode())
        return
    while True:  # a readable body (seekable: a retry starts it again from its first byte)
        piece = body.read(SEND_PIECE_BYTES)
        if not piece:
            return
        conn.send(piece)


def _cap_of(request: Any) -> int:
    """The most a streamed answer may hold: the range asked for and one byte (the byte that shows a store sent
    more than asked), else ANSWER_MAX_BYTES."""
    asked = request.headers.get("Range") or ""
    asked = asked.decode("latin-1") if isinstance(asked, bytes) else str(asked)
    first, _, last = asked.removeprefix(_RANGE).partition("-")
    if asked.startswith(_RANGE) and first.isdigit() and last.isdigit() and int(first) <= int(last):
        return int(last) - int(first) + 2
    return ANSWER_MAX_BYTES


def _host(url: urllib.parse.SplitResult) -> str:
    """The Host header botocore signed for `url` (its port only where it is not the scheme's own)."""
    host = url.hostname or ""
    host = f"[{host}]" if ":" in host else host
    if url.port is not None and url.port != {"http": 80, "https": 443}.get(url.scheme.lower()):
        host = f"{host}:{url.port}"
    return host


def _headers(response: Any) -> dict[str, str]:
    """The answer's headers, a repeated one joined as HTTP joins them; a Content-Length that is not a number is
    dropped (botocore would take it as one)."""
    out: dict[str, str] = {}
    for name, value in response.getheaders():
        key = name.lower()
        out[key] = f"{out[key]}, {value}" if key in out else value
    length = out.get("content-length")
    if length is not None and not (length.isdigit() and len(length) < 20):
        del out["content-length"]
    return out


def _proxy_auth(proxy: urllib.parse.SplitResult) -> dict[str, str]:
    if proxy.username is None:
        return {}
    who = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
    return {"Proxy-Authorization": "Basic " + base64.b64encode(who.encode()).decode()}
