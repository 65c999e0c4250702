"""The supervisor end of the heartbeat channel: a UNIX `SOCK_SEQPACKET` socket in a private directory.

`HeartbeatReceiver.drain()` returns the valid beats waiting, never blocking; everything else is dropped and counted
by reason (docs/design/run-loop.md, The heartbeat channel). It decides nothing about the job.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from ftsup import procs
from ftsup.protocol import DROP_REASONS, MAX_BEAT_BYTES, BadBeat, Beat, parse_beat
from ftsup.supervisor.policy import pace

"""Why a message or a connection was dropped: the `reason` label of `ftsup_heartbeats_dropped_total`."""

MAX_CONNECTIONS = 256  # far above the ranks of one node; each connection holds one descriptor
ACCEPT_BUDGET = 64  # new connections accepted per drain (also the listen backlog)
PER_CONNECTION = 32  # messages read per connection per drain: several seconds of a rank's beats

_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_ANCILLARY = socket.CMSG_SPACE(_UCRED.size)


def sender(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """(pid, uid) of a message's sender from its SCM_CREDENTIALS, or None when it has none."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid, uid, _gid = _UCRED.unpack_from(data)
            return pid, uid
    return None


def _admit_all(pid: int) -> bool:
    return True


def _believe_all(beat: Beat) -> str | None:
    return None


class _Attempt(Protocol):
    number: int
    started_at: float  # Unix time
    known_pids: set[int]
    mark: procs.Mark

    @property
    def pid(self) -> int: ...


@dataclass(frozen=True)
class Member:
    """A rank of an attempt as its process's environment names it (read once per process, at exec time's values)."""

    attempt: int
    rank: int
    local_rank: int


class Admission:
    """Which senders may beat, and which of their beats count. A sender must be a rank of the running attempt: a
    descendant of its torchrun started after it (or a rank already seen) that carries the attempt's mark and a `RANK`
    and `LOCAL_RANK` in its environment. Its beat counts when it claims that attempt, rank and local rank, and a step
    no further ahead than a step can be (`policy.pace`). One verdict per pid and attempt (a walk up its parents and
    one read of its environment), however many beats it sends."""

    MAX_STRANGERS = 4096

    def __init__(self) -> None:
        self._attempt = 0
        self._members: dict[int, Member] = {}
        self._strangers: set[int] = set()
        self._paces: dict[int, pace.Pace] = {}  # by rank, this attempt
        self._base: tuple[int, float] | None = None  # (resume step, launch time) of this attempt

    def launched(self, number: int, resume_step: int | None, now: float) -> None:
        """Attempt `number` was launched at `now` (the loop's clock) from `resume_step` (None: a fresh start)."""
        self._forget(number)
        self._base = (resume_step or 0, now)

    def admits(self, attempt: _Attempt | None, pid: int) -> bool:
        return self._member(attempt, pid) is not None

    def vet(self, attempt: _Attempt | None, beat: Beat, now: float) -> str | None:
        """Why the beat of an admitted sender does not count (one of `DROP_REASONS`), or None when it does."""
        member = self._member(attempt, beat.pid)
        if member is None:
            return "foreign"
        if (beat.attempt, beat.rank, beat.local_rank) != (member.attempt, member.rank, member.local_rank):
            return "forged"
        base_step, base_at = self._base if self._base is not None else (0, now)
        now_pace = pace.advance(self._paces.get(member.rank) or pace.start(base_step, base_at), beat.step, now)
        if now_pace is None:
            return "ahead"
        self._paces[member.rank] = now_pace
        return None

    def _member(self, attempt: _Attempt | None, pid: int) -> Member | None:
        if attempt is None:  # between attempts: the last beats of the last attempt's ranks are still read
            return self._members.get(pid)
        if attempt.number != self._attempt:
            self._forget(attempt.number)
        if pid in self._members:
            return self._members[pid]
        if pid in self._strangers:
            return None
        member = None
        if pid in attempt.known_pids or _descends(pid, attempt):
            member = _rank_of(pid, attempt)
        if member is None:
            if len(self._strangers) >= self.MAX_STRANGERS:
                self._strangers.clear()
            self._strangers.add(pid)
        else:
            self._members[pid] = member
        return member

    def _forget(self, number: int) -> None:
        self._attempt, self._members, self._strangers, self._paces, self._base = number, {}, set(), {}, None


def _descends(pid: int, attempt: _Attempt) -> bool:
    """Whether `pid` is a live descendant of the attempt's torchrun, started after it."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() >= attempt.started_at - 1 and any(p.pid == attempt.pid for p in proc.parents())
    except psutil.Error:
        return False


def _rank_of(pid: int, attempt: _Attempt) -> Member | None:
    """The rank `pid` is, by its environment, when it carries the attempt's mark and torchrun's rank variables."""
    env = procs.environ_of(pid, attempt.mark, since=attempt.started_at)
    if env is None:
        return None
    try:
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
    except (KeyError, ValueError):
        return None  # torchrun itself, or a process that is not a rank
    return Member(attempt.number, rank, local_rank) if rank >= 0 and local_rank >= 0 else None


class HeartbeatReceiver:
    """The listening socket and its connections; `drain()` once a tick, `close()` at the end."""

    def __init__(
        self,
        runtime_dir: str | os.PathLike[str],
        *,
        counter: Any = None,
        max_connections: int = MAX_CONNECTIONS,
        accept_budget: int = ACCEPT_BUDGET,
        per_connection: int = PER_CONNECTION,
    ) -> None:
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

    def drain(
        self, admit: Callable[[int], bool] = _admit_all, vet: Callable[[Beat], str | None] = _believe_all
    ) -> list[Beat]:
        """The valid beats waiting from admitted senders, oldest first per connection; never blocks. `vet(beat)` says
        why a beat of an admitted sender does not count (a `DROP_REASONS` entry), None when it does."""
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
                    beat = self._check(raw, ancillary, flags, admit)
                    why = vet(beat)
                except BadBeat as e:
                    why = e.reason
                if why is None:
                    beats.append(beat)
                    continue
                self._drop(why)
                if why != "ahead":  # the sender is the rank it says it is: its later beats may count
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

    def _check(
        self, raw: bytes, ancillary: list[tuple[int, int, bytes]], flags: int, admit: Callable[[int], bool]
    ) -> Beat:
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
