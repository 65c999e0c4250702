"""The operator's rollback requests as the daemon reads them: `<state_dir>/rollback.json`, written by
`ftsup rollback` (`cli.rollback`), polled by the loop (docs/design/state.md, Rollback requests).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ftsup import protocol
from ftsup.supervisor import statedir
from ftsup.supervisor.policy import machine as policy

FILE_NAME = "rollback.json"
POLL_S = 0.5


class RollbackWatcher:
    def __init__(self, state_dir: Path, *, clock: Callable[[], float], emit: Callable[..., None]) -> None:
        """`emit(level, event, **fields)` logs an event."""
        self.path = state_dir / FILE_NAME
        self._clock = clock
        self._emit = emit
        self._seen: tuple[int, ...] | None = None  # the file's fingerprint when last read (() : none there)
        self._next = -float("inf")

    def poll(self) -> list[policy.Event]:
        now = self._clock()
        if now < self._next:
            return []
        self._next = now + POLL_S
        try:
            mark = statedir.mark(self.path)
        except OSError as e:
            return self._ignored(None, f"cannot be looked at ({e.strerror or e})")
        if mark == self._seen:
            return []
        self._seen = mark
        if not mark:
            return []
        try:
            raw = statedir.read_private(self.path, protocol.MAX_ROLLBACK_BYTES, owner=os.geteuid())
            if raw is None:
                return []
            req = protocol.parse_rollback(raw)
        except OSError as e:  # a link, a FIFO, another user's file, too large
            return self._ignored(mark, e.strerror or str(e))
        except ValueError as e:
            return self._ignored(mark, str(e))
        return [policy.RollbackRequested(req.id, req.to_step, req.skips, req.who, req.reason)]

    def _ignored(self, mark: tuple[int, ...] | None, why: str) -> list[policy.Event]:
        if mark is None and self._seen == (-1,):
            return []  # told already
        self._seen = (-1,) if mark is None else mark
        self._emit("warning", "rollback_request_ignored", path=str(self.path), reason=why)
        return []
