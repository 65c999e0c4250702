"""An operator's request for the ranks' evidence now: `<state_dir>/capture.json`, written by `ftsup incidents
capture`, polled by the loop and read as hostile input (docs/design/state.md, Capture requests).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftsup.supervisor import statedir
from ftsup.supervisor.policy.events import CaptureRequested, Event

FILE_NAME = "capture.json"
VERSION = 1
MAX_BYTES = 4096
MAX_TEXT = 500
POLL_S = 0.5
STALE_S = 5.0  # a request written this long before the supervisor started is not for it: its "now" has passed
_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class CaptureRequest:
    id: str
    who: str
    reason: str
    requested_unix: float


def encode(req: CaptureRequest) -> bytes:
    body = {"v": VERSION, "id": req.id, "who": req.who, "reason": req.reason, "requested_unix": req.requested_unix}
    return json.dumps(body, sort_keys=True).encode()


def parse(raw: bytes) -> CaptureRequest:
    """The request in `raw`; ValueError saying what is wrong with it."""
    body = statedir.json_object(raw)
    if body.get("v") != VERSION:
        raise ValueError(f"not a capture request of version {VERSION}")
    if unknown := sorted(set(body) - {"v", "id", "who", "reason", "requested_unix"}):
        raise ValueError(f"unknown field {unknown[0][:40]!r}")
    rid, who, reason, when = body.get("id"), body.get("who", ""), body.get("reason", ""), body.get("requested_unix")
    if not isinstance(rid, str) or not _ID.fullmatch(rid):
        raise ValueError("'id' must be 16 hex digits")
    for key, text in (("who", who), ("reason", reason)):
        if not isinstance(text, str) or len(text) > MAX_TEXT or not text.isprintable():
            raise ValueError(f"{key!r} must be printable text of at most {MAX_TEXT} characters")
    if isinstance(when, bool) or not isinstance(when, int | float) or not (math.isfinite(when) and 0 < when < 1e12):
        raise ValueError("'requested_unix' must be a Unix time")
    return CaptureRequest(rid, who, reason, float(when))


class CaptureWatcher:
    def __init__(
        self, state_dir: Path, *, clock: Callable[[], float], emit: Callable[..., None], wall: Callable[[], float]
    ) -> None:
        """`emit(level, event, **fields)` logs an event; `wall()` is the Unix time (requests carry theirs)."""
        self._emit = emit
        self._started = wall()
        self._served: set[str] = set()
        self.file = statedir.RequestFile(
            state_dir / FILE_NAME, MAX_BYTES, clock=clock, poll_s=POLL_S, ignored=self._ignored
        )
        self.path = self.file.path

    def poll(self) -> list[Event]:
        raw = self.file.read()
        if raw is None:
            return []
        try:
            req = parse(raw)
        except ValueError as e:
            self._ignored(str(e))
            return []
        if req.id in self._served:
            return []
        self._served.add(req.id)
        if req.requested_unix < self._started - STALE_S:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(req.requested_unix))
            self._ignored(f"written at {when}, before this supervisor started: not served now")
            return []
        return [CaptureRequested(req.id, req.who, req.reason)]

    def _ignored(self, why: str) -> None:
        self._emit("warning", "capture_request_ignored", path=str(self.path), reason=why)
