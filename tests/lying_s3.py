"""A lying S3 endpoint for the tests: a real HTTP server on 127.0.0.1 (tests/hostile_s3.py) that forwards every
request to a real store (SeaweedFS, tests/s3server.py) but those its test picks, and answers these as no store
should: bodies without end, a listing of millions of names in one page or of thousands of pages, XML nested
without end, a body a byte at a time, a body cut short.

Every lie is a generator that costs the server no memory and stops once the client stops reading (or the server
stops). `LyingS3(upstream, lie)`: `lie(request)` returns a Reply to lie with, or None to forward the request.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from types import TracebackType

from tests.hostile_s3 import HostileS3, Reply, Request

NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
XML_HEAD = f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult {NS}><Name>b</Name>'.encode()
PIECE = 64 << 10
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class LyingS3:
    """`with LyingS3(upstream, lie) as s3: ... s3.endpoint ...`; `s3.lies` counts the answers lied with,
    `s3.sent` the bytes the lies sent."""

    def __init__(self, upstream: str, lie: Callable[[Request], Reply | None]) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.lie = lie
        self.lies = 0
        self.sent = 0
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.server = HostileS3(self._answer)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def requests(self) -> list[Request]:
        return self.server.requests

    def __enter__(self) -> LyingS3:
        self.server.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stopping.set()  # a trickle in progress ends at its next byte
        self.server.__exit__(kind, exc, tb)

    def _answer(self, request: Request) -> Reply:
        reply = self.lie(request)
        if reply is None:
            return self._forward(request)
        with self._lock:
            self.lies += 1
        if not isinstance(reply.body, bytes):
            reply = Reply(reply.status, self._counted(reply.body), reply.headers)
        return reply

    def _counted(self, body: Iterator[bytes]) -> Iterator[bytes]:
        for piece in body:
            if self.stopping.is_set():
                return
            with self._lock:
                self.sent += len(piece)
            yield piece

    def _forward(self, request: Request) -> Reply:
        """The request as the client sent it (its signature covers the Host header, kept as it came), to the real
        store; its answer streamed back."""
        conn = http.client.HTTPConnection(self.upstream.hostname or "", self.upstream.port, timeout=60)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        conn.putrequest(request.method, request.path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(request.body or None)
        answer = conn.getresponse()
        out = {k: v for k, v in answer.getheaders() if k.lower() not in _HOP}
        if request.method == "HEAD":
            conn.close()
            return Reply(answer.status, b"", out)

        def body() -> Iterator[bytes]:
            try:
                while piece := answer.read(PIECE):
                    yield piece
            finally:
                conn.close()

        return Reply(answer.status, body(), out)

    # ------------------------------------------------------------------ lies

    def trickle(self, data: bytes, every_s: float) -> Iterator[bytes]:
        """`data` a byte every `every_s` seconds (the server's own pace: the lie, not a test's wait)."""
        for i in range(len(data)):
            if self.stopping.wait(every_s):
                return
            yield data[i : i + 1]


def is_listing(request: Request) -> bool:
    return request.method == "GET" and request.query.get("list-type") == "2"


def endless(head: bytes, item: bytes) -> Iterator[bytes]:
    """`head`, then `item` for ever, a 64 KiB piece at a time."""
    yield head
    piece = item * max(1, PIECE // len(item))
    while True:
        yield piece


def endless_listing(prefix: str) -> Reply:
    """A listing whose one page never ends: step names, then more step names."""
    item = f"<CommonPrefixes><Prefix>{prefix}step-000000001/</Prefix></CommonPrefixes>".encode()
    return Reply(200, endless(XML_HEAD, item), {"Content-Type": "application/xml"})


def huge_listing(prefix: str, names: int) -> Reply:
    """One page of `names` distinct prefixes (1.5 million: about 100 MB), streamed with its length."""

    def items() -> Iterator[bytes]:
        yield XML_HEAD
        batch: list[bytes] = []
        for i in range(names):
            batch.append(f"<CommonPrefixes><Prefix>{prefix}x{i:09d}/</Prefix></CommonPrefixes>".encode())
            if len(batch) == 1000:
                yield b"".join(batch)
                batch = []
        yield b"".join(batch) + b"<IsTruncated>false</IsTruncated></ListBucketResult>"

    per = len(f"<CommonPrefixes><Prefix>{prefix}x000000000/</Prefix></CommonPrefixes>")
    length = len(XML_HEAD) + per * names + len(b"<IsTruncated>false</IsTruncated></ListBucketResult>")
    return Reply(200, items(), {"Content-Type": "application/xml", "Content-Length": str(length)})


def page(prefix: str, number: int) -> Reply:
    """Page `number` of a listing that always has one more page, one step name on each."""
    body = (
        XML_HEAD
        + f"<Prefix>{prefix}</Prefix><IsTruncated>true</IsTruncated><NextContinuationToken>t{number}"
        f"</NextContinuationToken><CommonPrefixes><Prefix>{prefix}step-{number:09d}/</Prefix></CommonPrefixes>"
        "</ListBucketResult>".encode()
    )
    return Reply(200, body, {"Content-Type": "application/xml"})


def nested_listing(depth: int) -> Reply:
    """A listing whose XML nests `depth` elements inside one another (streamed, closed at the end)."""

    def items() -> Iterator[bytes]:
        yield XML_HEAD + b"<CommonPrefixes><Prefix>"
        for _ in range(0, depth, 4096):
            yield b"<a>" * 4096
        for _ in range(0, depth, 4096):
            yield b"</a>" * 4096
        yield b"</Prefix></CommonPrefixes><IsTruncated>false</IsTruncated></ListBucketResult>"

    return Reply(200, items(), {"Content-Type": "application/xml"})


def entity_bomb() -> Reply:
    """A listing that defines an entity a billion characters long in a few hundred bytes."""
    levels = ['<!ENTITY l0 "xxxxxxxxxx">'] + [f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 10)]
    doc = f'<?xml version="1.0"?><!DOCTYPE r [{"".join(levels)}]><ListBucketResult {NS}><Prefix>&l9;</Prefix>'
    return Reply(200, (doc + "</ListBucketResult>").encode(), {"Content-Type": "application/xml"})


def truncated(status: int, data: bytes, cut: int) -> Reply:
    """`data` announced whole (its Content-Length), its first `cut` bytes sent, then the connection closed."""
    return Reply(status, iter([data[:cut]]), {"Content-Length": str(len(data)), "Content-Type": "application/xml"})


def endless_error(status: int = 500) -> Reply:
    """An error document that never ends."""
    head = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>'
    return Reply(status, endless(head, b"A" * 1024), {"Content-Type": "application/xml"})


def endless_object() -> Reply:
    """An object's answer that never ends, whatever the range asked for."""
    return Reply(206, endless(b"", b"\0" * 1024), {})
