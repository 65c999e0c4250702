"""The operator's rollback requests as the daemon reads them: `<state_dir>/rollback.json`, written by
`ftsup rollback` (`cli.rollback`), polled by the loop (docs/design/state.md, Rollback requests).
"""

from __future__ import annotations

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
        self._emit = emit
        self.file = statedir.RequestFile(
            state_dir / FILE_NAME, protocol.MAX_ROLLBACK_BYTES, clock=clock, poll_s=POLL_S, ignored=self._ignored
        )
        self.path = self.file.path

    def poll(self) -> list[policy.Event]:
        raw = self.file.read()
        if raw is None:
            return []
        try:
            req = protocol.parse_rollback(raw)
        except ValueError as e:
            self._ignored(str(e))
            return []
        return [policy.RollbackRequested(req.id, req.to_step, req.skips, req.who, req.reason)]

    def _ignored(self, why: str) -> None:
        self._emit("warning", "rollback_request_ignored", path=str(self.path), reason=why)
