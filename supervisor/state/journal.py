"""The supervisor's journal: what it was doing, on disk, atomically, so that a restarted supervisor can adopt or
clean up what it left. A journal read back is hostile input (docs/design/state.md, The journal).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ftsup import protocol
from ftsup.supervisor import statedir
from ftsup.supervisor.errors import SupervisorError
from ftsup.supervisor.policy import goodput

FORMAT = 1
MAX_BYTES = 1 << 20
MAX_PIDS = 4096
STATUSES = ("starting", "running", "backoff", "succeeded", "failed", "evicted", "stopped")
MAX_SERVED = 64
MAX_INCIDENT_BYTES = 8192


class JournalError(SupervisorError):
    """A journal file exists but cannot be used as written."""


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
    skips: tuple[tuple[int, int], ...] = ()  # the data skips in force
    rollbacks_served: tuple[str, ...] = ()  # ids of the operator rollback requests served, newest last
    incident: dict[str, Any] | None = None  # the last anomaly or operator rollback (`policy.anomaly.Incident`)
    stragglers: tuple[int, ...] = ()  # global ranks reported as stragglers now
    goodput: dict[str, Any] | None = None  # the job's time accounting so far (`goodput.Saved`)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["pids"] = list(self.pids)
        d["skips"] = [list(r) for r in self.skips]
        d["rollbacks_served"] = list(self.rollbacks_served)
        d["stragglers"] = list(self.stragglers)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_json(cls, raw: object) -> JournalRecord:
        """Check every field's type and range; raise `JournalError` naming the first bad one."""
        if not isinstance(raw, dict):
            raise JournalError("not a JSON object")
        raw = dict(raw)
        raw.pop("format", None)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise JournalError(f"unknown field {unknown[0]!r}")
        for key in ("run_id", "node_id", "supervisor_pid"):
            if key not in raw:
                raise JournalError(f"no {key!r}")
        _want(raw, "run_id", str)
        _want(raw, "node_id", str)
        _want_int(raw, "supervisor_pid", 0)
        _want_int(raw, "attempt", 0)
        _want_int(raw, "world_size", 1, nullable=True)
        _want_int(raw, "resume_step", 0, nullable=True)
        _want_number(raw, "attempt_started_unix", nullable=True)
        _want_number(raw, "updated_unix")
        _want(raw, "last_failure", str, nullable=True)
        _want(raw, "extra", dict)
        if raw.get("status", "starting") not in STATUSES:
            raise JournalError(f"'status' must be one of {', '.join(STATUSES)}")
        pids = raw.get("pids", [])
        if not isinstance(pids, list) or len(pids) > MAX_PIDS:
            raise JournalError(f"'pids' must be a list of at most {MAX_PIDS} pids")
        for p in pids:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 1 << 22:
                raise JournalError(f"'pids' holds {p!r}, not a pid")
        raw["pids"] = tuple(pids)
        try:
            raw["skips"] = protocol.check_data_skips(raw.get("skips", []), "'skips'")
        except ValueError as e:
            raise JournalError(str(e)) from None
        served = raw.get("rollbacks_served", [])
        if not isinstance(served, list) or len(served) > MAX_SERVED or not all(isinstance(i, str) for i in served):
            raise JournalError(f"'rollbacks_served' must be a list of at most {MAX_SERVED} request ids")
        raw["rollbacks_served"] = tuple(served)
        _want(raw, "incident", dict, nullable=True)
        if raw.get("incident") is not None and len(json.dumps(raw["incident"])) > MAX_INCIDENT_BYTES:
            raise JournalError(f"'incident' is more than {MAX_INCIDENT_BYTES} bytes")
        stragglers = raw.get("stragglers", [])
        if (
            not isinstance(stragglers, list)
            or len(stragglers) > MAX_PIDS
            or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < 1 << 24 for r in stragglers)
        ):
            raise JournalError("'stragglers' must be a list of ranks")
        raw["stragglers"] = tuple(stragglers)
        if raw.get("goodput") is not None:
            try:
                raw["goodput"] = goodput.Saved.from_json(raw["goodput"]).to_json()
            except ValueError as e:
                raise JournalError(f"'goodput': {e}") from None
        return cls(**raw)


def _want(raw: dict[str, Any], key: str, kind: type, *, nullable: bool = False) -> None:
    if key not in raw or (nullable and raw[key] is None):
        return
    if not isinstance(raw[key], kind):
        raise JournalError(f"{key!r} must be a {kind.__name__}, got {type(raw[key]).__name__}")


def _want_int(raw: dict[str, Any], key: str, low: int, *, nullable: bool = False) -> None:
    if key not in raw or (nullable and raw[key] is None):
        return
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 1 << 62:
        raise JournalError(f"{key!r} must be an integer >= {low}, got {v!r}")


def _want_number(raw: dict[str, Any], key: str, *, nullable: bool = False) -> None:
    if key not in raw or (nullable and raw[key] is None):
        return
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e12:
        raise JournalError(f"{key!r} must be a time in seconds, got {v!r}")


class Journal:
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def read(self, *, owner: int | None = None) -> JournalRecord | None:
        """The last record, or None when there is none. Raises `JournalError` for a file that is
        a link, not a regular file, too large, owned by someone other than `owner` (when given),
        or not a journal."""
        return statedir.read_json(self.path, MAX_BYTES, JournalError, JournalRecord.from_json, owner=owner)

    def write(self, record: JournalRecord, *, durable: bool = True) -> None:
        """Replace the record (`durable`: fsynced, so that it survives the node's crash too, not only ours)."""
        data = json.dumps(record.to_json(), indent=1, sort_keys=True).encode()
        statedir.write_atomic(self.path, data, durable=durable)
