"""The ranks as their supervisor last heard them, for `ftsup status`: `<state_dir>/ranks.json`, written by the
daemon (`RankTable`) and read back as hostile input (`read`; docs/design/state.md, The ranks as last heard).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftsup.protocol import Beat, Phase
from ftsup.supervisor import statedir
from ftsup.supervisor.errors import SupervisorError

FORMAT = 1
FILE_NAME = "ranks.json"
MAX_BYTES = 1 << 20
MAX_RANKS = 4096
WRITE_EVERY_S = 1.0


class RankStatusError(SupervisorError):
    """A ranks.json exists but cannot be used as written."""


@dataclass(frozen=True)
class RankStatus:
    rank: int
    local_rank: int
    pid: int
    step: int
    phase: str
    loss: float | None
    beat_unix: float  # when the supervisor read its newest beat


class RankTable:
    def __init__(
        self, path: Path, *, write: Callable[[Path, Callable[[], None]], object], wall: Callable[[], float] = time.time
    ) -> None:
        """`write(path, op)` carries out one write (`Outages.guard` with this file's purpose); `wall()` is the time
        written into the file."""
        self.path = path
        self._write = write
        self._wall = wall
        self._attempt = 0
        self._ranks: dict[int, RankStatus] = {}  # local rank ->
        self._changed = False
        self._written_at: float | None = None  # the loop's clock

    def started(self, attempt: int) -> None:
        """A new attempt: no rank heard from yet (written at the next `flush`)."""
        self._attempt, self._ranks, self._changed, self._written_at = attempt, {}, True, None

    def heard(self, beat: Beat) -> None:
        loss = dict(beat.figures).get("loss")
        loss = float(loss) if loss is not None and math.isfinite(loss) else None
        self._ranks[beat.local_rank] = RankStatus(
            beat.rank, beat.local_rank, beat.pid, beat.step, str(beat.phase), loss, round(self._wall(), 3)
        )
        self._changed = True

    def heard_of(self) -> dict[int, RankStatus]:
        """Each rank's newest beat of this attempt, by local rank."""
        return dict(self._ranks)

    def flush(self, now: float) -> None:
        """Write the table when it changed and the last write is `WRITE_EVERY_S` old."""
        if not self._changed or (self._written_at is not None and now - self._written_at < WRITE_EVERY_S):
            return
        self._changed, self._written_at = False, now
        body = {
            "format": FORMAT,
            "attempt": self._attempt,
            "written_unix": round(self._wall(), 3),
            "ranks": [asdict(r) for _, r in sorted(self._ranks.items())],
        }
        data = json.dumps(body, sort_keys=True).encode()
        self._write(self.path, lambda: statedir.write_atomic(self.path, data, durable=False))


def read(path: Path) -> tuple[int, float, list[RankStatus]] | None:
    """(attempt, written_unix, ranks) of the file, None when there is none; `RankStatusError` for one that is a
    link, not a regular file, too large, someone else's, or not such a table."""
    return statedir.read_json(path, MAX_BYTES, RankStatusError, _checked, owner=os.geteuid())


def _checked(raw: Any) -> tuple[int, float, list[RankStatus]]:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RankStatusError(f"not a ranks table of format {FORMAT}")
    attempt = _int(raw, "attempt")
    written = _time(raw, "written_unix")
    ranks = raw.get("ranks")
    if not isinstance(ranks, list) or len(ranks) > MAX_RANKS:
        raise RankStatusError(f"'ranks' must be a list of at most {MAX_RANKS}")
    out = []
    for r in ranks:
        if not isinstance(r, dict):
            raise RankStatusError("a rank that is not an object")
        phase = r.get("phase")
        if phase not in {p.value for p in Phase}:
            raise RankStatusError(f"'phase' {str(phase)[:40]!r} is not a phase")
        loss = r.get("loss")
        number = isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)
        if loss is not None and not number:
            raise RankStatusError(f"'loss' {str(loss)[:40]!r} is not a number")
        rank, local_rank, pid, step = (_int(r, key) for key in ("rank", "local_rank", "pid", "step"))
        loss = None if loss is None else float(loss)
        out.append(RankStatus(rank, local_rank, pid, step, phase, loss, _time(r, "beat_unix")))
    return attempt, written, out


def _int(raw: dict[str, Any], key: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62:
        raise RankStatusError(f"{key!r} must be an integer >= 0, got {str(v)[:40]!r}")
    return v


def _time(raw: dict[str, Any], key: str) -> float:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e12:
        raise RankStatusError(f"{key!r} must be a time in seconds, got {str(v)[:40]!r}")
    return float(v)
