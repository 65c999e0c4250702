"""The supervisor end of the heartbeat channel: a UNIX `SOCK_SEQPACKET` socket in a private directory.

Ranks connect and send one JSON message per beat (the format is `ftsup.trainer.runtime.encode_beat`'s).
`HeartbeatReceiver.drain()` returns the valid beats waiting, never blocking; everything else is
dropped and counted by reason (`DROP_REASONS`), and the connection it came on is closed:

- `malformed`: not a beat of this schema (too long, nested, not JSON, a field missing, of the
  wrong type or out of range, an unknown phase, a bad figure). `parse_beat` checks the size and
  the nesting before it parses anything, so no message can cost more than a few microseconds;
- `version`: a beat of another protocol version (a trainer and a supervisor of different ftsup
  releases);
- `spoofed`: the pid the beat claims is not the sender's, as the kernel reports it
  (`SCM_CREDENTIALS`, asked for with `SO_PASSCRED`), or the sender runs as another user;
- `foreign`: the sender is not a process the caller admits (the daemon admits the processes of
  its running attempt, `Admission`), checked when it connects and for every beat;
- `refused`: a connection beyond `max_connections`.

Each connection has a queue of its own, so a process that floods the socket fills only its own
queue; each drain accepts at most `accept_budget` connections and reads at most
`per_connection` messages from each, so a flood costs the supervisor a bounded amount of work
per drain, however fast it comes. The directory is created 0700 and the socket 0600, so only
this user's processes can connect. This module decides nothing about the job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from ftsup.trainer.runtime import (
    BASE_FIELDS,
    FIGURE_NAME,
    MAX_BEAT_BYTES,
    MAX_FIGURES,
    MAX_STEP,
    PHASES,
    PROTOCOL_VERSION,
)

DROP_REASONS = ("malformed", "version", "spoofed", "foreign", "refused")
"""Why a message or a connection was dropped: the `reason` label of `ftsup_heartbeats_dropped_total`."""

MAX_CONNECTIONS = 256  # far above the ranks of one node; each connection holds one descriptor
ACCEPT_BUDGET = 64  # new connections accepted per drain (also the listen backlog)
PER_CONNECTION = 32  # messages read per connection per drain: several seconds of a rank's beats

_INT_LIMITS = {"attempt": 2**31 - 1, "rank": 2**24, "local_rank": 2**16, "pid": 2**22, "step": MAX_STEP}
_MAX_INT_DIGITS = 20  # no field or figure needs more; Python would otherwise parse 4300 digits
_MAX_KEYS = len(BASE_FIELDS) + MAX_FIGURES
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_ANCILLARY = socket.CMSG_SPACE(_UCRED.size)


@dataclass(frozen=True)
class Beat:
    attempt: int
    rank: int
    local_rank: int
    pid: int  # verified: the kernel's word for the sender, when it comes out of drain()
    step: int
    phase: str
    sent_unix: float
    sent_mono: float  # the sender's monotonic clock (the same clock on every process of a machine)
    figures: tuple[tuple[str, float], ...] = ()  # a figure that was not finite at the rank is NaN


class BadBeat(ValueError):
    """A message that is not a beat; `reason` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a number here")


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError("an integer of more than 20 digits")
    return int(digits)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    if len(pairs) > _MAX_KEYS:
        raise ValueError(f"more than {_MAX_KEYS} keys")
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("a key given twice")
    return obj


def _int_field(m: dict[str, object], key: str, low: int = 0) -> int:
    value = m.get(key)
    if type(value) is not int or not low <= value <= _INT_LIMITS[key]:
        raise BadBeat("malformed", f"{key} must be an integer in [{low}, {_INT_LIMITS[key]}], not {value!r:.40}")
    return value


def _finite(value: object) -> float | None:
    """A JSON number as a finite float, else None (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _time_field(m: dict[str, object], key: str) -> float:
    value = _finite(m.get(key))
    if value is None or value < 0:
        raise BadBeat("malformed", f"{key} must be a finite number >= 0, not {m.get(key)!r:.40}")
    return value


def parse_beat(raw: bytes) -> Beat:
    """Check one message against the schema and return the beat it holds (its pid as claimed);
    BadBeat otherwise. Nothing is parsed that is longer than MAX_BEAT_BYTES or nested."""
    if len(raw) > MAX_BEAT_BYTES:
        raise BadBeat("malformed", f"{len(raw)} bytes, more than {MAX_BEAT_BYTES}")
    # A beat is one flat object, and none of its strings (phase, figure names) holds a bracket:
    # anything else with a bracket is not a beat, whatever its depth.
    if raw.count(b"{") != 1 or raw.count(b"}") != 1 or b"[" in raw:
        raise BadBeat("malformed", "not one flat JSON object")
    try:
        m = json.loads(raw.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constants,
                       object_pairs_hook=_unique_keys)  # fmt: skip
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise BadBeat("malformed", f"not JSON: {e}") from None
    if not isinstance(m, dict):
        raise BadBeat("malformed", "not a JSON object")
    v = m.get("v")
    if type(v) is not int:
        raise BadBeat("malformed", f"v must be an integer, not {v!r:.40}")
    if v != PROTOCOL_VERSION:
        raise BadBeat("version", f"protocol version {v}, this supervisor speaks {PROTOCOL_VERSION}")
    phase = m.get("phase")
    if not isinstance(phase, str) or phase not in PHASES:
        raise BadBeat("malformed", f"phase must be one of {PHASES}, not {phase!r:.40}")
    figures: list[tuple[str, float]] = []
    for name, value in m.items():
        if name in BASE_FIELDS:
            continue
        if not FIGURE_NAME.match(name):
            raise BadBeat("malformed", f"figure name {name!r:.80} is not an identifier of at most 64 characters")
        number = math.nan if value is None else _finite(value)
        if number is None:
            raise BadBeat("malformed", f"figure {name} must be a finite number or null, not {value!r:.40}")
        figures.append((name, number))
    if len(figures) > MAX_FIGURES:
        raise BadBeat("malformed", f"{len(figures)} figures, more than {MAX_FIGURES}")
    return Beat(
        attempt=_int_field(m, "attempt"), rank=_int_field(m, "rank"), local_rank=_int_field(m, "local_rank"),
        pid=_int_field(m, "pid", low=1), step=_int_field(m, "step"), phase=phase,
        sent_unix=_time_field(m, "t"), sent_mono=_time_field(m, "mono"), figures=tuple(sorted(figures)),
    )  # fmt: skip


def sender(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """(pid, uid) of a message's sender from its SCM_CREDENTIALS, or None when it has none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid, uid, _gid = _UCRED.unpack_from(data)
            return pid, uid
    return None


def _admit_all(pid: int) -> bool:
    return True


class _Attempt(Protocol):
    number: int
    started_at: float  # Unix time
    known_pids: set[int]

    @property
    def pid(self) -> int: ...


class Admission:
    """Which senders may beat: the processes of the running attempt, that is descendants of its
    torchrun (started after it), or ranks already seen. One verdict per pid and attempt, so a
    sender costs one walk up its parents, however many beats it sends."""

    MAX_STRANGERS = 4096

    def __init__(self) -> None:
        self._attempt = 0
        self._members: set[int] = set()
        self._strangers: set[int] = set()

    def admits(self, attempt: _Attempt | None, pid: int) -> bool:
        if attempt is None:  # between attempts: the last beats of the last attempt's ranks are still read
            return pid in self._members
        if attempt.number != self._attempt:
            self._attempt, self._members, self._strangers = attempt.number, set(), set()
        if pid in self._members:
            return True
        if pid in self._strangers:
            return False
        ok = pid in attempt.known_pids or _descends(pid, attempt)
        if not ok and len(self._strangers) >= self.MAX_STRANGERS:
            self._strangers.clear()
        (self._members if ok else self._strangers).add(pid)
        return ok


def _descends(pid: int, attempt: _Attempt) -> bool:
    """Whether `pid` is a live descendant of the attempt's torchrun, started after it."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() >= attempt.started_at - 1 and any(p.pid == attempt.pid for p in proc.parents())
    except psutil.Error:
        return False


class HeartbeatReceiver:
    """The listening socket and its connections; `drain()` once a tick, `close()` at the end."""

    def __init__(
        self, runtime_dir: str | os.PathLike[str], *, counter: Any = None, max_connections: int = MAX_CONNECTIONS,
        accept_budget: int = ACCEPT_BUDGET, per_connection: int = PER_CONNECTION,
    ) -> None:  # fmt: skip
        """`counter`: a prometheus Counter with a `reason` label, counted with every drop."""
        self.dir = Path(runtime_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.path = self.dir / "heartbeat.sock"
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.max_connections, self.accept_budget, self.per_connection = max_connections, accept_budget, per_connection
        self.uid = os.geteuid()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            # Set before any connection exists: accepted connections inherit it, so every message
            # arrives with its sender's credentials.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            self.sock.listen(accept_budget)
        except BaseException:
            self.sock.close()
            raise
        self._conns: dict[int, socket.socket] = {}  # by file descriptor
        self._counter = counter
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)  # since start
        self._unlogged: dict[str, int] = {}
        self._logged_at = -math.inf

    @property
    def connections(self) -> int:
        return len(self._conns)

    def drain(self, admit: Callable[[int], bool] = _admit_all) -> list[Beat]:
        """The valid beats waiting from admitted senders, oldest first per connection; never blocks."""
        self._accept(admit)
        beats: list[Beat] = []
        for fd, conn in list(self._conns.items()):
            for _ in range(self.per_connection):
                try:
                    raw, ancillary, flags, _ = conn.recvmsg(MAX_BEAT_BYTES + 1, _ANCILLARY, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:  # reset by the peer
                    self._close(fd)
                    break
                if not raw and not ancillary:  # the peer closed its end
                    self._close(fd)
                    break
                try:
                    beats.append(self._check(raw, ancillary, flags, admit))
                except BadBeat as e:
                    self._drop(e.reason)
                    self._close(fd)  # a peer that sent one bad message gets no more reads
                    break
        return beats

    def drops_to_log(self, now: float, every_s: float) -> dict[str, Any] | None:
        """The fields of a `heartbeats_dropped` event when there were drops since the last one and
        the last one is `every_s` old (a flood makes one line every `every_s`, not one per message)."""
        if not self._unlogged or now - self._logged_at < every_s:
            return None
        drops, self._unlogged, self._logged_at = self._unlogged, {}, now
        return {"dropped": drops, "reason": ", ".join(f"{n} {r}" for r, n in sorted(drops.items()))}

    def _check(self, raw: bytes, ancillary: list[tuple[int, int, bytes]], flags: int, admit: Callable[[int], bool]
               ) -> Beat:  # fmt: skip
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise BadBeat("malformed", f"more than {MAX_BEAT_BYTES} bytes")
        beat = parse_beat(raw)
        who = sender(ancillary)
        if who is None or who[1] != self.uid or who[0] != beat.pid:
            raise BadBeat("spoofed", f"claims pid {beat.pid}, sent by {who}")
        if not admit(beat.pid):
            raise BadBeat("foreign", f"pid {beat.pid} is not admitted")
        return beat

    def _accept(self, admit: Callable[[int], bool]) -> None:
        for _ in range(self.accept_budget):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or a connection aborted before we took it
                self._drop("refused")
                return
            conn.setblocking(False)
            if len(self._conns) >= self.max_connections:
                conn.close()
                self._drop("refused")
                continue
            pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            if uid != self.uid:
                conn.close()
                self._drop("spoofed")
            elif not admit(pid):
                conn.close()
                self._drop("foreign")
            else:
                self._conns[conn.fileno()] = conn

    def _drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        if self._counter is not None:
            self._counter.labels(reason).inc()

    def _close(self, fd: int) -> None:
        conn = self._conns.pop(fd, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for fd in list(self._conns):
            self._close(fd)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> HeartbeatReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
