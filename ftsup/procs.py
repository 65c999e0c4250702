"""Processes of an attempt: how they are recognised (`Mark`, `verify`, `find`), and the one way they are stopped.

Stdlib, psutil and `ftsup.protocol` only, so both sides use it (docs/design/process-and-protocol.md, Processes of
an attempt).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import psutil

from ftsup.protocol import ATTEMPT_ENV, NODE_ID_ENV, RUN_ID_ENV

CREATE_SLACK_S = 1.0  # process start times are rounded to clock ticks, and computed from the boot time
_POLL_S = 0.02
_KILL_WAIT_S = 5.0


@dataclass(frozen=True)
class Mark:
    """What every process of one attempt carries in its environment."""

    run_id: str
    node_id: str
    attempt: int

    def environ(self) -> dict[str, str]:
        return {RUN_ID_ENV: self.run_id, NODE_ID_ENV: self.node_id, ATTEMPT_ENV: str(self.attempt)}

    def carried_by(self, env: Mapping[str, str]) -> bool:
        return all(env.get(k) == v for k, v in self.environ().items())


def alive(p: psutil.Process) -> bool:
    """Running (or stopped), not a zombie, and still the process `p` was created for."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pid_alive(pid: int) -> bool:
    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def run_state(pid: int, *, proc: str = "/proc") -> tuple[str, int] | None:
    """(its state, its start time) as `/proc/PID/stat` says: the state letter (R running, S sleeping, D in
    uninterruptible sleep, T stopped, Z zombie, ...) and the start time in clock ticks after boot, which tells the
    process from a later one given the same pid. None: no such process, or a file that does not read as one."""
    try:
        with open(f"{proc}/{int(pid)}/stat", "rb") as f:
            data = f.read(4096)
    except (OSError, ValueError):
        return None
    fields = data[data.rfind(b")") + 1 :].split()  # the command name before it may hold spaces and parentheses
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return fields[0].decode("ascii", "replace")[:1], int(fields[19])


def verify(
    pid: int, mark: Mark, *, since: float, until: float | None = None, uid: int | None = None
) -> psutil.Process | None:
    """The process `pid` if it is a process of the attempt `mark` (created in `[since, until]`,
    owned by `uid`, default ours), else None."""
    try:
        return _check(psutil.Process(pid), mark, since, until, os.getuid() if uid is None else uid)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def environ_of(
    pid: int, mark: Mark, *, since: float, until: float | None = None, uid: int | None = None
) -> dict[str, str] | None:
    """The environment of `pid` (fixed at its exec) if it is a process of the attempt `mark`, as `verify` checks, else
    None: one read of /proc/PID/environ for the mark and what else it names (a rank's RANK)."""
    try:
        p = psutil.Process(pid)
        return _checked_environ(p, mark, since, until, os.getuid() if uid is None else uid)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def find(mark: Mark, *, since: float, until: float | None = None) -> list[psutil.Process]:
    """Every live process of the attempt `mark`, by a scan of this user's processes."""
    uid = os.getuid()
    found = []
    for p in psutil.process_iter():
        try:
            if _check(p, mark, since, until, uid) is not None:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return found


def _check(p: psutil.Process, mark: Mark, since: float, until: float | None, uid: int) -> psutil.Process | None:
    return p if _checked_environ(p, mark, since, until, uid) is not None else None


def _checked_environ(
    p: psutil.Process, mark: Mark, since: float, until: float | None, uid: int
) -> dict[str, str] | None:
    if p.uids().real != uid:
        return None
    created = p.create_time()
    if created < since - CREATE_SLACK_S or (until is not None and created > until + CREATE_SLACK_S):
        return None  # a recycled pid, or a process of another lifetime
    env = p.environ()
    if not mark.carried_by(env) or not alive(p):
        return None
    return env


def descendants(roots: Iterable[int | psutil.Process]) -> list[psutil.Process]:
    """The live processes among `roots` and all their descendants."""
    found: dict[int, psutil.Process] = {}
    for r in roots:
        try:
            root = r if isinstance(r, psutil.Process) else psutil.Process(r)
            found[root.pid] = root
            for c in root.children(recursive=True):
                found[c.pid] = c
        except psutil.NoSuchProcess:
            continue
    return [p for p in found.values() if alive(p)]


def signal_all(procs: Iterable[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)  # psutil refuses a pid that now names another process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def stop(
    found: Callable[[], Iterable[psutil.Process]],
    grace_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    reap: Callable[[], object] = lambda: None,
) -> list[int]:
    """Stop everything `found()` returns, the one way: SIGTERM + SIGCONT, one grace deadline
    (processes found meanwhile get the same), SIGKILL to what is left, then a check.

    `found` is called again while waiting, so a process that appears during the stop (torchrun
    starting a rank) is stopped too; `reap` is called while waiting (a `Popen.poll`). With
    `grace_s <= 0` everything gets SIGKILL at once. Returns the pids still alive at the end.
    """
    seen: dict[int, psutil.Process] = {}

    def refresh(sigs: tuple[int, ...]) -> list[psutil.Process]:
        for p in found():
            if p.pid not in seen or not alive(seen[p.pid]):
                seen[p.pid] = p
                for sig in sigs:
                    signal_all([p], sig)
        return [p for p in seen.values() if alive(p)]

    deadline = clock() + max(0.0, grace_s)
    left = refresh((signal.SIGTERM, signal.SIGCONT)) if grace_s > 0 else refresh(())
    while left and clock() < deadline:
        reap()
        time.sleep(min(_POLL_S, max(0.0, deadline - clock())))
        left = refresh((signal.SIGTERM, signal.SIGCONT))
    signal_all(left, signal.SIGKILL)
    kill_deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        reap()
        left = refresh((signal.SIGKILL,))
        if not left or time.monotonic() >= kill_deadline:
            break
        time.sleep(_POLL_S)
    reap()
    return sorted(p.pid for p in left if alive(p))
