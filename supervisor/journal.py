"""The supervisor's journal: what it was doing, on disk, atomically, so a restarted supervisor
(after `kill -9`, a node reboot, a systemd restart) can adopt or clean up what it left.

One JSON file per node: run id, attempt number, world size, chosen step, pids of the running
attempt (torchrun and its ranks), last failure, and the time it was written. It is replaced
atomically (tmp file, fsync, rename, fsync dir), so a reader sees the old or the new record,
never half of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint.layout import write_json_atomic

FORMAT = 1


@dataclass(frozen=True)
class JournalRecord:
    run_id: str
    node_id: str
    supervisor_pid: int
    attempt: int = 0
    world_size: int | None = None
    resume_step: int | None = None
    pids: tuple[int, ...] = ()
    attempt_started_unix: float | None = None
    last_failure: str | None = None
    status: str = "starting"  # starting | running | backoff | succeeded | failed | evicted | stopped
    updated_unix: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["pids"] = list(self.pids)
        d["format"] = FORMAT
        return d


class Journal:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def read(self) -> JournalRecord | None:
        """The last record, or None when there is none or it cannot be read (logged by the caller)."""
        try:
            raw = json.loads(self.path.read_text())
            raw.pop("format", None)
            raw["pids"] = tuple(raw.get("pids", ()))
            return JournalRecord(**raw)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return None

    def write(self, record: JournalRecord) -> None:
        write_json_atomic(self.path, record.to_json())
