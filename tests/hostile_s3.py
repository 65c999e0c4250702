"""A hostile S3 endpoint for the tests: an HTTP server on 127.0.0.1 whose every answer a test writes.

A real store (SeaweedFS, `tests/s3server.py`) answers as S3 does; what ftsup must survive besides is a store, or
something posing as one, that answers as no store should: listings that say "there is more" for ever, an object
larger than it was asked for, a range answered short, error messages full of control characters. `HostileS3`
serves each request with the test's `answer(request) -> Reply`, counts them, and is stopped (its thread joined) by
its context manager. Signatures are not checked: the client under test signs as it always does.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


@dataclass(frozen=True)
class Request:
    method: str
    key: str  # the object key, without the bucket (path-style addressing)
    query: dict[str, str]
    headers: dict[str, str]
    path: str = ""  # as sent: the bucket, the key and the query, still quoted
    body: bytes = b""


@dataclass
class Reply:
    status: int = 200
    body: bytes | Iterator[bytes] = b""
    headers: dict[str, str] = field(default_factory=dict)


def xml(body: str) -> Reply:
    return Reply(200, f'<?xml version="1.0" encoding="UTF-8"?>{body}'.encode(), {"Content-Type": "application/xml"})


def error(status: int, code: str, message: str) -> Reply:
    text = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    return Reply(status, f'<?xml version="1.0" encoding="UTF-8"?>{text}'.encode(), {"Content-Type": "application/xml"})


class HostileS3:
    """`with HostileS3(answer) as s3: ... s3.endpoint ...`; `s3.requests` lists what was asked."""

    def __init__(self, answer: Callable[[Request], Reply]) -> None:
        self.answer = answer
        self.requests: list[Request] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                _, _, key = url.path.lstrip("/").partition("/")
                query = {
                    k: v[0] if v else "" for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()
                }
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = dict(self.headers.items())
                request = Request(self.command, urllib.parse.unquote(key), query, headers, self.path, body)
                owner.requests.append(request)
                reply = owner.answer(request)
                chunks = [reply.body] if isinstance(reply.body, bytes) else reply.body
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                if isinstance(reply.body, bytes) and "Content-Length" not in reply.headers:
                    self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                try:
                    for chunk in chunks:
                        self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading: what a capped reader does

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _serve

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="hostile-s3", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HostileS3:
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
