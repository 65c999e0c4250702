"""A minimal HTTP client for metadata endpoints (stdlib only, hard timeouts, no proxies).

Metadata services are link-local and must never go through a proxy, so the opener ignores
proxy environment variables. Every failure is an `HttpError` with a short reason.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HttpError(OSError):
    pass


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: Mapping[str, str]


def request(
    method: str,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float = 2.0,
    max_bytes: int = 1 << 20,
) -> Response:
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return Response(resp.status, resp.read(max_bytes), {k.lower(): v for k, v in resp.headers.items()})
    except urllib.error.HTTPError as e:  # 4xx/5xx still carry a documented meaning (404: no notice)
        return Response(e.code, e.read(max_bytes) if e.fp else b"", {k.lower(): v for k, v in e.headers.items()})
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise HttpError(f"{method} {url}: {reason}") from None
