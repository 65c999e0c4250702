"""This node's files in the state directory: its quarantine journal (kept across supervisors), the operator's clear
requests (`ftsup nodes clear`) and the view of its last checks (`ftsup nodes`, `ftsup status`), each read back as
hostile input (docs/design/state.md, Node quarantine).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftsup.supervisor import statedir
from ftsup.supervisor.errors import SupervisorError
from ftsup.supervisor.policy import nodes

QUARANTINE = "quarantine.json"
CLEAR = "quarantine-clear.json"
VIEW = "node-health.json"
VERSION = 1
MAX_QUARANTINE_BYTES = 4 << 20  # the largest book `nodes` keeps is well under it (docs/design/state.md)
MAX_CLEAR_BYTES = 4096
MAX_VIEW_BYTES = 64 * 1024
MAX_SLOT = nodes.MAX_TARGETS - 1  # slots 0 .. MAX_SLOT - 1
MAX_TEXT = 1000  # a reason or a detail, in characters
STANDBY_ROLES = ("waiting", "joined")
_ID = re.compile(r"[0-9a-f]{4,32}")
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TARGET = re.compile(r"node|slot:(0|[1-9][0-9]{0,3})")


class NodeFileError(SupervisorError):
    """A file of this node's state cannot be used as it is; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ClearRequest:
    """An operator's clear (`ftsup nodes clear`): `slots` None clears the node and every slot."""

    id: str
    slots: tuple[int, ...] | None
    who: str
    requested_unix: float

    def encode(self) -> bytes:
        slots = None if self.slots is None else list(self.slots)
        body = {"v": VERSION, "id": self.id, "slots": slots, "who": self.who, "requested_unix": self.requested_unix}
        return json.dumps(body, sort_keys=True).encode()


@dataclass(frozen=True)
class View:
    """This node as its supervisor last saw it: its checks, why its next attempt waits, a hot spare's role."""

    node_id: str
    checked_unix: float | None
    verdict: nodes.Verdict
    deferred: str | None  # why the next attempt waits; None: it does not
    retry_unix: float | None
    standby: str | None  # one of STANDBY_ROLES, None: no spare, or neither

    def encode(self) -> bytes:
        body = {
            "v": VERSION,
            "node_id": self.node_id,
            "checked_unix": self.checked_unix,
            "healthy": self.verdict.healthy,
            "checks": [{"check": c.name, "result": c.result, "detail": clean(c.detail)} for c in self.verdict.checks],
            "deferred": None if self.deferred is None else clean(self.deferred),
            "retry_unix": self.retry_unix,
            "standby": self.standby,
        }
        return json.dumps(body, sort_keys=True).encode()


def clean(text: str) -> str:
    """`text` as a file of ours may hold it: printable, at most MAX_TEXT characters."""
    return "".join(ch for ch in text if ch.isprintable())[:MAX_TEXT]


# ---------------------------------------------------------------------- the quarantine journal


def encode(book: nodes.Book, node_id: str, now: float) -> bytes:
    body = {
        "v": VERSION,
        "node_id": node_id,
        "written_unix": now,
        "entries": [
            {
                "target": e.target,
                "faults": list(e.faults),
                "until": e.until,
                "reason": clean(e.reason),
                "quarantines": e.quarantines,
            }
            for e in book.entries
        ],
        "served": list(book.served),
    }
    return json.dumps(body, sort_keys=True).encode()


def write(path: Path, book: nodes.Book, node_id: str, now: float) -> None:
    """Replace the journal at `path` (atomically and durably, never through a link)."""
    statedir.write_atomic(path, encode(book, node_id, now))


def read(path: Path) -> nodes.Book | None:
    """The quarantine journaled at `path`, None when there is none; NodeFileError when it cannot be used."""
    body = _load(path, MAX_QUARANTINE_BYTES)
    if body is None:
        return None
    where = str(path)
    _fields(body, where, {"v", "node_id", "written_unix", "entries", "served"})
    _node_id(body.get("node_id"), where)
    _unix(body.get("written_unix"), where, "written_unix")
    entries, served = body.get("entries"), body.get("served")
    if not isinstance(entries, list) or len(entries) > nodes.MAX_TARGETS:
        raise NodeFileError(f"{where}: 'entries' must be a list of at most {nodes.MAX_TARGETS}")
    if not isinstance(served, list) or len(served) > nodes.MAX_SERVED:
        raise NodeFileError(f"{where}: 'served' must be a list of at most {nodes.MAX_SERVED} request ids")
    for rid in served:
        if not isinstance(rid, str) or not _ID.fullmatch(rid):
            raise NodeFileError(f"{where}: 'served' holds {str(rid)[:40]!r}, not a request id")
    book = nodes.Book(served=tuple(served))
    for i, raw in enumerate(entries):
        entry = _entry(raw, f"{where}: entries[{i}]")
        if book.get(entry.target) is not None:
            raise NodeFileError(f"{where}: entries[{i}]: target {entry.target!r} is listed twice")
        book = book.put(entry)
    return book


def _entry(raw: object, where: str) -> nodes.Entry:
    if not isinstance(raw, dict):
        raise NodeFileError(f"{where}: must be an object")
    _fields(raw, where, {"target", "faults", "until", "reason", "quarantines"})
    target, faults, until = raw.get("target"), raw.get("faults"), raw.get("until")
    reason, count = raw.get("reason"), raw.get("quarantines")
    if not isinstance(target, str) or not _TARGET.fullmatch(target) or _slot_of(target) >= MAX_SLOT:
        raise NodeFileError(f"{where}: 'target' must be 'node' or 'slot:N' (N below {MAX_SLOT})")
    if not isinstance(faults, list) or len(faults) > nodes.MAX_FAULTS:
        raise NodeFileError(f"{where}: 'faults' must be a list of at most {nodes.MAX_FAULTS} Unix times")
    times = tuple(sorted(_unix(t, where, "faults") for t in faults))
    if until is not None:
        until = _unix(until, where, "until")
    if type(count) is not int or not 0 <= count < 2**31:
        raise NodeFileError(f"{where}: 'quarantines' must be a count")
    return nodes.Entry(target, times, until, _text(reason, where, "reason"), count)


def _slot_of(target: str) -> int:
    return int(target[5:]) if target.startswith("slot:") else -1


# ---------------------------------------------------------------------- clear requests


def read_clear(path: Path) -> ClearRequest | None:
    """The operator's clear request at `path`, None when there is none; NodeFileError when it cannot be used."""
    body = _load(path, MAX_CLEAR_BYTES)
    if body is None:
        return None
    where = str(path)
    _fields(body, where, {"v", "id", "slots", "who", "requested_unix"})
    rid, slots = body.get("id"), body.get("slots")
    if not isinstance(rid, str) or not _ID.fullmatch(rid):
        raise NodeFileError(f"{where}: 'id' must be 4 to 32 hex digits")
    if slots is not None and (
        not isinstance(slots, list)
        or not 0 < len(slots) <= 64
        or not all(type(s) is int and 0 <= s < MAX_SLOT for s in slots)
    ):
        raise NodeFileError(f"{where}: 'slots' must be null or a list of at most 64 slot numbers below {MAX_SLOT}")
    who = _text(body.get("who"), where, "who")
    when = _unix(body.get("requested_unix"), where, "requested_unix")
    return ClearRequest(rid, None if slots is None else tuple(slots), who, when)


# ---------------------------------------------------------------------- the view


def read_view(path: Path) -> View | None:
    """The view of this node at `path`, None when there is none; NodeFileError when it cannot be used."""
    body = _load(path, MAX_VIEW_BYTES)
    if body is None:
        return None
    where = str(path)
    _fields(body, where, {"v", "node_id", "checked_unix", "healthy", "checks", "deferred", "retry_unix", "standby"})
    node_id = _node_id(body.get("node_id"), where)
    checked, retry = body.get("checked_unix"), body.get("retry_unix")
    checked = None if checked is None else _unix(checked, where, "checked_unix")
    retry = None if retry is None else _unix(retry, where, "retry_unix")
    healthy, raw_checks, deferred, standby = (body.get(k) for k in ("healthy", "checks", "deferred", "standby"))
    if healthy not in (True, False, None):
        raise NodeFileError(f"{where}: 'healthy' must be true, false or null")
    if not isinstance(raw_checks, list) or len(raw_checks) > len(nodes.CHECKS):
        raise NodeFileError(f"{where}: 'checks' must be a list of at most {len(nodes.CHECKS)}")
    checks = []
    for i, c in enumerate(raw_checks):
        at = f"{where}: checks[{i}]"
        if not isinstance(c, dict):
            raise NodeFileError(f"{at}: must be an object")
        _fields(c, at, {"check", "result", "detail"})
        if c.get("check") not in nodes.CHECKS or c.get("result") not in nodes.RESULTS:
            raise NodeFileError(f"{at}: 'check' must be one of {nodes.CHECKS}, 'result' one of {nodes.RESULTS}")
        checks.append(nodes.Check(c["check"], c["result"], _text(c.get("detail"), at, "detail")))
    deferred = None if deferred is None else _text(deferred, where, "deferred")
    if standby is not None and standby not in STANDBY_ROLES:
        raise NodeFileError(f"{where}: 'standby' must be null or one of {STANDBY_ROLES}")
    return View(node_id, checked, nodes.Verdict(healthy, tuple(checks)), deferred, retry, standby)


# ---------------------------------------------------------------------- reading hostile files


def _load(path: Path, max_bytes: int) -> dict[str, Any] | None:
    """The JSON object of a regular file of this user's at `path` (never through a link, at most `max_bytes`), None
    when there is none."""
    return statedir.read_json(path, max_bytes, NodeFileError, _versioned, owner=os.geteuid())


def _versioned(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("v") != VERSION:
        raise NodeFileError(f"not an object of version {VERSION}")
    return body


def _fields(body: dict[str, Any], where: str, allowed: set[str]) -> None:
    if unknown := sorted(set(body) - allowed):
        raise NodeFileError(f"{where}: unknown field {unknown[0][:40]!r}")


def _unix(value: object, where: str, key: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and 0 <= value < 1e12)
    ):
        raise NodeFileError(f"{where}: {key!r} must hold Unix times")
    return float(value)


def _text(value: object, where: str, key: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT or not value.isprintable():
        raise NodeFileError(f"{where}: {key!r} must be printable text of at most {MAX_TEXT} characters")
    return value


def _node_id(value: object, where: str) -> str:
    if not isinstance(value, str) or not _NODE_ID.fullmatch(value):
        raise NodeFileError(f"{where}: 'node_id' must be a node id")
    return value
