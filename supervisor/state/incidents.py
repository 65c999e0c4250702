"""Incident records: `<state_dir>/incidents/<ID>.json`, one per hang, straggler, operator capture or anomaly, written
atomically with a size cap and a retention, and read back as hostile input (docs/design/state.md, Incident records).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ftsup.protocol import Phase
from ftsup.supervisor import statedir
from ftsup.supervisor.errors import SupervisorError
from ftsup.supervisor.policy import evidence, stacks
from ftsup.supervisor.policy.stacks import Thread

FORMAT = 1
DIR_NAME = "incidents"
MAX_BYTES = 4 << 20  # a record; stacks past it are cut, the innermost frames kept
MAX_RANKS = 4096
MAX_LINES = 20  # a rank's last log lines kept
MAX_TEXT = 2000  # a reason, a problem, a log line
MAX_PROBLEMS = 16
MAX_LISTED = 1000  # records read by one listing (the newest); the rest are counted, not read
MAX_DUMP_BYTES = 64 << 20  # one NCCL flight recorder dump copied into an incident
ID = re.compile(r"\d{8}T\d{9}Z-\d{4,10}-(" + "|".join(evidence.TRIGGERS) + r")-[0-9a-f]{4}")
_STATES = re.compile(r"[A-Za-z]|gone")


class IncidentError(SupervisorError):
    """An incident record that cannot be used as written (a link, too large, not JSON, not a record)."""


@dataclass(frozen=True)
class NcclDump:
    """A rank's NCCL flight recorder dump, copied beside the record as `<ID>.nccl-rank<RANK>` (a pickle: never
    loaded by ftsup; torch's `fr_trace` reads it)."""

    rank: int
    file: str
    bytes: int


@dataclass(frozen=True)
class RankEvidence:
    """One rank as the capture found it."""

    rank: int
    local_rank: int
    pid: int | None = None
    state: str | None = None  # /proc/PID/stat's letter before the capture, or `gone`
    wchan: str | None = None  # where the kernel has its main thread wait
    threads: tuple[Thread, ...] = ()
    tool: str | None = None  # the tool whose stack this is (pystack, py-spy); None: none gave one
    problems: tuple[str, ...] = ()  # what failed on the way (a tool missing, refused, timed out)
    collective: bool | None = None  # its stack waits inside a collective (None: no stack)
    step: int | None = None  # its last heartbeat: step, phase, when it was read
    phase: str | None = None
    beat_unix: float | None = None
    log_tail: tuple[str, ...] = ()  # the last lines of its own output (stderr, else stdout)


@dataclass(frozen=True)
class Incident:
    id: str
    trigger: str  # `evidence.TRIGGERS`
    event: str  # the event that said why (heartbeat_timed_out, straggler_detected, anomaly_detected, ...)
    created_unix: float
    run_id: str
    node_id: str
    attempt: int
    reason: str
    step: int | None = None
    culprit: int | None = None  # the rank the evidence blames (global)
    culprit_why: str = ""
    blamed: int | None = None  # the rank the policy blamed when it decided
    duration_s: float | None = None  # the capture's
    timeout_s: float | None = None
    complete: bool = True  # every rank's evidence came back within the bound
    ranks: tuple[RankEvidence, ...] = ()
    nccl: tuple[NcclDump, ...] = ()
    anomaly: dict[str, Any] | None = None  # an anomaly's or a rollback's details (`policy.anomaly.Incident`)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("ranks", "nccl")}
        out["format"] = FORMAT
        out["ranks"] = [
            {**{k: v for k, v in r.__dict__.items() if k != "threads"}, "threads": [t.__dict__ for t in r.threads]}
            for r in self.ranks
        ]
        out["nccl"] = [d.__dict__ for d in self.nccl]
        return json.loads(json.dumps(out))  # tuples as lists

    def summary(self) -> dict[str, Any]:
        """What `ftsup incidents` lists of it."""
        keys = ("id", "trigger", "event", "created_unix", "attempt", "step", "culprit", "culprit_why", "reason")
        return {k: getattr(self, k) for k in keys} | {"duration_s": self.duration_s, "ranks": len(self.ranks)}


def new_id(trigger: str, attempt: int, wall: float) -> str:
    ms = int(wall * 1000) % 1000
    return (
        f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(wall))}{ms:03d}Z-{attempt:04d}-{trigger}-{secrets.token_hex(2)}"
    )


def encode(incident: Incident) -> bytes:
    """The record as written: within `MAX_BYTES`, the stacks cut (outer frames first, then threads but the main
    one, then log lines) until it fits."""
    data = json.dumps(incident.to_json(), sort_keys=True).encode()
    for keep in (64, 16, 4, 0):
        if len(data) <= MAX_BYTES:
            break
        incident = replace(incident, ranks=tuple(_shrunk(r, keep) for r in incident.ranks))
        data = json.dumps(incident.to_json(), sort_keys=True).encode()
    return data


def _shrunk(r: RankEvidence, frames: int) -> RankEvidence:
    threads = tuple(
        replace(t, frames=t.frames[-frames:] if frames else (), cut=t.cut or len(t.frames) > frames)
        for t in r.threads
        if t.main or frames >= 16
    )
    return replace(r, threads=threads, log_tail=r.log_tail[-frames // 4 :] if frames else ())


# --------------------------------------------------------------------------- the directory


class Store:
    """The incident directory of one state directory: written by the daemon, read by `ftsup incidents`."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / DIR_NAME

    def path(self, incident_id: str) -> Path:
        if not ID.fullmatch(incident_id):
            raise IncidentError(f"{incident_id[:80]!r} is not an incident id (`ftsup incidents` lists them)")
        return self.dir / f"{incident_id}.json"

    def ensure(self) -> Path:
        return statedir.ensure_dir(self.dir, "job.state_dir")

    def write(self, incident: Incident, keep: int) -> list[str]:
        """Write `incident`, then delete the oldest records beyond `keep` (and their dumps); the ids deleted."""
        self.ensure()
        statedir.write_atomic(self.path(incident.id), encode(incident))
        return self.prune(keep)

    def ids(self) -> list[str]:
        """The ids of the records here, oldest first (names that are not a record's are left alone)."""
        try:
            names = [e.name for e in os.scandir(self.dir)]
        except FileNotFoundError:
            return []
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json") and ID.fullmatch(n[: -len(".json")]))

    def prune(self, keep: int) -> list[str]:
        ids = self.ids()
        gone = ids[: max(0, len(ids) - keep)]
        doomed = set(gone)
        for entry in os.scandir(self.dir):
            if entry.name.split(".", 1)[0] in doomed and not entry.is_dir(follow_symlinks=False):
                try:
                    os.unlink(entry.path)  # a link here is removed itself, never what it points to
                except FileNotFoundError:
                    pass
        return gone

    def read(self, incident_id: str) -> Incident:
        path = self.path(incident_id)
        found = statedir.read_json(
            path, MAX_BYTES, IncidentError, lambda raw: parse(raw, incident_id), owner=os.geteuid()
        )
        if found is None:
            raise IncidentError(f"{path}: no such incident (`ftsup incidents` lists them)")
        return found

    def read_all(self) -> tuple[list[Incident], list[str]]:
        """The records here, newest first (at most `MAX_LISTED`), and one line for each that could not be read."""
        found, problems = [], []
        ids = self.ids()
        if len(ids) > MAX_LISTED:
            problems.append(f"{self.dir}: {len(ids)} records; the newest {MAX_LISTED} are read")
        for incident_id in reversed(ids[-MAX_LISTED:]):
            try:
                found.append(self.read(incident_id))
            except IncidentError as e:
                problems.append(f"{e}; skipped")
        return found, problems

    def dump_path(self, incident_id: str, rank: int) -> Path:
        return self.path(incident_id).with_name(f"{incident_id}.nccl-rank{int(rank)}")


def copy_dump(src: Path, dst: Path, max_bytes: int = MAX_DUMP_BYTES) -> int:
    """Copy a flight recorder dump the ranks wrote into the incident directory: `src` opened without following a link,
    only a regular file of ours and at most `max_bytes`; `dst` created new (never through a link). Its size."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > max_bytes:
            raise OSError(f"{src}: not a regular file of ours of at most {max_bytes} bytes; refused")
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            copied = 0
            while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - copied)):
                os.write(out, chunk)
                copied += len(chunk)
                if copied > max_bytes:
                    raise OSError(f"{src}: grew past {max_bytes} bytes while copied; refused")
            return copied
        finally:
            os.close(out)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading a record back


def parse(raw: object, incident_id: str | None = None) -> Incident:
    """A record read back, every field checked (it is a file anyone with this user's rights could have written)."""
    r = _Obj(raw, "the record")
    if r.get("format") != FORMAT:
        raise IncidentError(f"'format' must be {FORMAT}, got {str(r.get('format'))[:20]!r}")
    got = r.text("id", 64)
    if not ID.fullmatch(got) or (incident_id is not None and got != incident_id):
        raise IncidentError(f"'id' {got!r} is not this record's name")
    trigger = r.text("trigger", 32)
    if trigger not in evidence.TRIGGERS:
        raise IncidentError(f"'trigger' must be one of {', '.join(evidence.TRIGGERS)}, got {trigger!r}")
    ranks = r.items("ranks", MAX_RANKS)
    nccl = r.items("nccl", MAX_RANKS)
    anomaly = r.get("anomaly")
    if anomaly is not None and (not isinstance(anomaly, dict) or len(json.dumps(anomaly)) > 8192):
        raise IncidentError("'anomaly' must be an object of at most 8192 bytes")
    return Incident(
        id=got,
        trigger=trigger,
        event=r.text("event", 64),
        created_unix=r.number("created_unix"),
        run_id=r.text("run_id", 256),
        node_id=r.text("node_id", 256),
        attempt=r.integer("attempt"),
        reason=r.text("reason", MAX_TEXT),
        step=r.integer("step", null=True),
        culprit=r.integer("culprit", null=True),
        culprit_why=r.text("culprit_why", MAX_TEXT),
        blamed=r.integer("blamed", null=True),
        duration_s=r.number("duration_s", null=True),
        timeout_s=r.number("timeout_s", null=True),
        complete=r.flag("complete"),
        ranks=tuple(_rank(_Obj(x, f"ranks[{i}]")) for i, x in enumerate(ranks)),
        nccl=tuple(_dump(_Obj(x, f"nccl[{i}]")) for i, x in enumerate(nccl)),
        anomaly=anomaly,
    )


def _rank(r: _Obj) -> RankEvidence:
    state = r.text("state", 8, null=True)
    if state is not None and not _STATES.fullmatch(state):
        raise IncidentError(f"{r.where}: 'state' {state!r} is not a process state")
    phase = r.text("phase", 16, null=True)
    if phase is not None and phase not in {p.value for p in Phase}:
        raise IncidentError(f"{r.where}: 'phase' {phase!r} is not a phase")
    return RankEvidence(
        rank=r.integer("rank"),
        local_rank=r.integer("local_rank"),
        pid=r.integer("pid", null=True),
        state=state,
        wchan=r.text("wchan", 128, null=True),
        threads=tuple(_thread(_Obj(x, f"{r.where}.threads[{i}]")) for i, x in enumerate(r.items("threads", 256))),
        tool=r.text("tool", 32, null=True),
        problems=r.texts("problems", MAX_PROBLEMS, MAX_TEXT),
        collective=r.flag("collective", null=True),
        step=r.integer("step", null=True),
        phase=phase,
        beat_unix=r.number("beat_unix", null=True),
        log_tail=r.texts("log_tail", MAX_LINES, MAX_TEXT),
    )


def _thread(r: _Obj) -> Thread:
    return Thread(
        name=r.text("name", 64),
        tid=r.integer("tid", null=True),
        main=r.flag("main"),
        frames=r.texts("frames", 4 * stacks.MAX_FRAMES, stacks.MAX_FRAME_CHARS),
        status=r.text("status", 32),
        cut=r.flag("cut"),
    )


def _dump(r: _Obj) -> NcclDump:
    rank, file = r.integer("rank"), r.text("file", 128)
    if file != f"{file.split('.nccl-rank')[0]}.nccl-rank{rank}" or not ID.fullmatch(file.split(".nccl-rank")[0]):
        raise IncidentError(f"{r.where}: 'file' {file!r} is not a dump's name")
    return NcclDump(rank, file, r.integer("bytes"))


class _Obj:
    """A JSON object read field by field, each check naming where it failed."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            raise IncidentError(f"{where} is not a JSON object")
        self.raw: Mapping[str, Any] = raw
        self.where = where

    def get(self, key: str) -> Any:
        return self.raw.get(key)

    def _fail(self, key: str, what: str) -> IncidentError:
        return IncidentError(f"{self.where}: {key!r} must be {what}, got {str(self.raw.get(key))[:40]!r}")

    def text(self, key: str, cap: int, *, null: bool = False) -> Any:
        v = self.raw.get(key, "" if not null else None)
        if v is None and null:
            return None
        if not isinstance(v, str) or len(v) > cap:
            raise self._fail(key, f"text of at most {cap} characters")
        return "".join(c if c.isprintable() else "?" for c in v)

    def texts(self, key: str, count: int, cap: int) -> tuple[str, ...]:
        v = self.items(key, count)
        if not all(isinstance(x, str) and len(x) <= cap for x in v):
            raise self._fail(key, f"a list of texts of at most {cap} characters")
        return tuple("".join(c if c.isprintable() else "?" for c in x) for x in v)

    def items(self, key: str, count: int) -> Sequence[Any]:
        v = self.raw.get(key, [])
        if not isinstance(v, list) or len(v) > count:
            raise self._fail(key, f"a list of at most {count} items")
        return v

    def integer(self, key: str, *, null: bool = False) -> Any:
        v = self.raw.get(key)
        if v is None and null:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62:
            raise self._fail(key, "an integer >= 0" + (" or null" if null else ""))
        return v

    def number(self, key: str, *, null: bool = False) -> Any:
        v = self.raw.get(key)
        if v is None and null:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e12:
            raise self._fail(key, "a number >= 0" + (" or null" if null else ""))
        return float(v)

    def flag(self, key: str, *, null: bool = False) -> Any:
        v = self.raw.get(key, None if null else False)
        if v is None and null:
            return None
        if not isinstance(v, bool):
            raise self._fail(key, "true or false")
        return v
