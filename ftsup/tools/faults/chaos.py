"""Faults injected from outside a running job, as an operator or a chaos tool would, and what can be observed from
outside: the ranks (by the `RANK`/`LOCAL_RANK` torchrun sets), the supervisor's journal and JSON log, the loss log,
what is left running. It never talks to the supervisor and decides nothing. Times are wall-clock (`time.time()`),
as the supervisor's log lines are.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psutil

from ftsup import procs
from ftsup.supervisor import statedir
from ftsup.supervisor.errors import SupervisorError
from ftsup.supervisor.state import incidents, journal

T = TypeVar("T")

POLL_S = 0.01
STOP_RESEND_S = 0.25  # a SIGSTOP not seen to take by then is sent again
STOP_CONFIRM_S = 5.0
FAILURE_EVENTS = ("worker_exited", "heartbeat_timed_out", "progress_timed_out", "startup_timed_out")
_AGENT_MARK = "torch.distributed.run"
_LOAD_RE = re.compile(r"checkpoint_loaded\b.*?\bduration_s=([0-9.]+)")


class ChaosError(SupervisorError):
    """An expected observation did not happen (in time): the job did not get where we waited for it."""


def poll_until(check: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = POLL_S) -> T:
    """Call `check` every `interval_s` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got is not None and got is not False:
            return got
        if time.monotonic() >= deadline:
            raise ChaosError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class RankProcess:
    """One rank process, identified by pid and creation time (so a recycled pid is never signalled)."""

    rank: int
    local_rank: int
    pid: int
    create_time: float

    def process(self) -> psutil.Process | None:
        try:
            p = psutil.Process(self.pid)
            return p if p.create_time() == self.create_time else None
        except psutil.NoSuchProcess:
            return None


alive = procs.alive


def read_journal(state_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The supervisor's journal record, or None when there is none yet (it is replaced atomically), or it is not
    a regular file of at most the journal's size limit, not through a link (`statedir.read_private`)."""
    try:
        data = statedir.read_private(Path(state_dir) / "journal.json", journal.MAX_BYTES)
        raw = None if data is None else json.loads(data)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def journal_attempt(state_dir: str | os.PathLike[str]) -> int:
    """The number of the supervisor's last attempt, as journaled (0 before the first)."""
    n = (read_journal(state_dir) or {}).get("attempt")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The live processes among `pids` and all their descendants."""
    return procs.descendants(pids)


def job_processes(state_dir: str | os.PathLike[str]) -> list[psutil.Process]:
    """The processes of a supervised job's current attempt: the journal's pids and their children."""
    rec = read_journal(state_dir)
    if rec is None:
        return []
    started = rec.get("attempt_started_unix")
    procs = []
    for p in tree(int(x) for x in rec.get("pids", ())):
        try:
            if started is None or p.create_time() >= float(started) - 1:  # not a recycled pid
                procs.append(p)
        except psutil.NoSuchProcess:
            continue
    return procs


def rank_processes(procs: Iterable[psutil.Process]) -> dict[int, RankProcess]:
    """Rank processes by global rank: torchrun's children carrying RANK and LOCAL_RANK.

    Children of a rank (data loader workers, a background writer) inherit the environment, so a
    process counts only when its parent is not itself a rank.
    """
    out: dict[int, RankProcess] = {}
    for p in procs:
        try:
            env = p.environ()
            if "RANK" not in env or "LOCAL_RANK" not in env or _AGENT_MARK in " ".join(p.cmdline()):
                continue
            parent = p.parent()
            if parent is not None and "LOCAL_RANK" in parent.environ():
                continue
            out[int(env["RANK"])] = RankProcess(int(env["RANK"]), int(env["LOCAL_RANK"]), p.pid, p.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return out


def supervised_ranks(state_dir: str | os.PathLike[str]) -> dict[int, RankProcess]:
    return rank_processes(job_processes(state_dir))


def ranks_under(pid: int) -> dict[int, RankProcess]:
    """Rank processes below a process we started ourselves (plain torchrun)."""
    return rank_processes(tree([pid]))


def wait_for_ranks(find: Callable[[], dict[int, RankProcess]], n: int, timeout_s: float) -> dict[int, RankProcess]:
    def enough() -> dict[int, RankProcess] | None:
        found = find()
        return found if len(found) >= n else None

    return poll_until(enough, timeout_s, f"{n} rank processes")


def send(rank: RankProcess, sig: int) -> float:
    """Signal one rank; returns when it was sent. Raises ChaosError when the process is gone.

    A SIGSTOP is sent until the rank is seen stopped (state T): one that arrives while a tracer attaches to the
    rank (a stack capture: ptrace's own stop) merges with the tracer's stop and is gone when it detaches, and the
    rank goes on. The time returned is that of the SIGSTOP that took."""
    p = rank.process()
    if p is None:
        raise ChaosError(
            f"rank {rank.rank} (pid {rank.pid}) is gone before it could be sent {signal.Signals(sig).name}"
        )
    t = time.time()
    p.send_signal(sig)
    if sig != signal.SIGSTOP:
        return t
    deadline = t + STOP_CONFIRM_S
    while time.time() < deadline:
        time.sleep(POLL_S)
        try:
            if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return t
            if time.time() - t >= STOP_RESEND_S:
                t = time.time()
                p.send_signal(sig)
        except psutil.NoSuchProcess:
            return t
    raise ChaosError(f"rank {rank.rank} (pid {rank.pid}) was sent SIGSTOP and is not stopped {STOP_CONFIRM_S:g} s on")


def hang_incident(state_dir: str | os.PathLike[str], since_unix: float) -> dict[str, Any]:
    """The first incident record of a hang the supervisor kept since `since_unix` (read as `ftsup incidents` reads
    it): its id, the rank it names and why; {"incident": None} when there is none."""
    found, _ = incidents.Store(Path(state_dir)).read_all()
    hangs = sorted((i for i in found if i.trigger == "hang" and i.created_unix >= since_unix), key=lambda i: i.id)
    if not hangs:
        return {"incident": None}
    first = hangs[0]
    return {"incident": first.id, "incident_rank": first.culprit, "incident_why": first.culprit_why}


def kill_process(pid: int) -> float:
    """SIGKILL one process (the supervisor itself); returns when the signal was sent."""
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def matching_processes(markers: Sequence[str], *, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """Live processes whose command line or environment mentions any of `markers` (a run's
    checkpoint dir, `FTSUP_RUN_ID=<id>`), minus `exclude`, this process and its ancestors."""
    skip = {os.getpid(), *exclude}
    me = psutil.Process()
    skip.update(p.pid for p in me.parents())
    found = []
    for p in psutil.process_iter(["cmdline", "environ"], ad_value=None):
        if p.pid in skip:
            continue
        info = p.info
        text = " ".join(info.get("cmdline") or ())
        env = info.get("environ") or {}
        text += "\0" + "\0".join(f"{k}={v}" for k, v in env.items())
        if any(m in text for m in markers) and alive(p):
            found.append(p)
    return found


def stop_all(found: Sequence[psutil.Process]) -> None:
    """SIGKILL every process at once and wait for them (`procs.stop` with no grace): cleanup, not a measurement."""
    procs.stop(lambda: found, 0)


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} ({p.status()}): {' '.join(p.cmdline())[:160]}"
    except psutil.NoSuchProcess:
        return f"pid {p.pid} (gone)"


# --------------------------------------------------------------------------- the loss log


@dataclass(frozen=True)
class LossLine:
    t: float  # wall-clock time the line was first seen (within one poll interval of its write)
    step: int
    record: dict[str, Any]


class LossLogTail:
    """Follows a loss log (JSON lines with "step") in a thread, timestamping each new line.

    A context manager: the thread runs between `__enter__` and `close()`. A line counts once it
    ends with a newline; a line that does not parse is counted in `bad_lines`, never guessed at.
    """

    def __init__(self, path: str | os.PathLike[str], interval_s: float = POLL_S):
        self.path = Path(path)
        self.interval_s = interval_s
        self.bad_lines = 0
        self._lines: list[LossLine] = []
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # the thread's reads and `current_step`'s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tail {self.path.name}", daemon=True)

    def __enter__(self) -> LossLogTail:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._read()  # whatever was written last

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()

    def _read(self) -> None:
        with self._reading:
            self._read_locked()

    def _read_locked(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        if not chunk:
            return
        now = time.time()
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        new = []
        for raw in complete:
            try:
                rec = json.loads(raw)
                new.append(LossLine(now, int(rec["step"]), rec))
            except (ValueError, KeyError, TypeError):
                self.bad_lines += 1
        with self._lock:
            self._lines.extend(new)

    def lines(self) -> list[LossLine]:
        with self._lock:
            return list(self._lines)

    def current_step(self) -> int:
        """The highest step the file holds now: read first, since the thread's view lags by a poll, and by seconds
        where the host is busy."""
        self._read()
        return self.max_step()

    def latest_step(self) -> int:
        """The step of the line logged last (read first, as `current_step`), 0 when none: where the job is now,
        behind `max_step` while it trains again what a rollback lost."""
        self._read()
        lines = self.lines()
        return lines[-1].step if lines else 0

    def max_step(self, before: float | None = None) -> int:
        """The highest step logged (before wall time `before`), 0 when none."""
        return max((ln.step for ln in self.lines() if before is None or ln.t <= before), default=0)

    def wait_for(self, pred: Callable[[LossLine], bool], timeout_s: float, what: str) -> LossLine:
        def first() -> LossLine | None:
            return next((ln for ln in self.lines() if pred(ln)), None)

        return poll_until(first, timeout_s, what)

    def wait_for_step(self, step: int, timeout_s: float) -> LossLine:
        return self.wait_for(lambda ln: ln.step >= step, timeout_s, f"loss log {self.path} reaching step {step}")

    def first_after(self, t: float) -> LossLine | None:
        return next((ln for ln in self.lines() if ln.t > t), None)


def last_line_per_step(path: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Each step's line from the last attempt that logged it (later lines win); torn lines skipped."""
    out: dict[int, dict[str, Any]] = {}
    for rec in json_lines(path):
        try:
            out[int(rec["step"])] = rec
        except (ValueError, KeyError, TypeError):
            continue
    return out


def json_lines(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (none when it does not exist); other lines skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


# --------------------------------------------------------------------------- the supervisor's logs


@dataclass(frozen=True)
class LogEvent:
    t: float  # wall-clock seconds
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


def read_events(path: str | os.PathLike[str]) -> list[LogEvent]:
    """The supervisor's JSON log lines (every `ftsup run` of the job appends to the same file)."""
    out: list[LogEvent] = []
    for rec in json_lines(path):
        try:
            t = datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
            out.append(LogEvent(t, str(rec["event"]), rec))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def first_event(events: Sequence[LogEvent], names: Iterable[str], after: float) -> LogEvent | None:
    wanted = set(names)
    return next((e for e in events if e.event in wanted and e.t >= after), None)


def load_durations(text: str) -> list[float]:
    """Every `checkpoint_loaded ... duration_s=X` a rank printed (one per rank and load)."""
    return [float(m.group(1)) for m in _LOAD_RE.finditer(text)]


def attempt_load_s(log_dir: str | os.PathLike[str], attempt: int) -> float | None:
    """The slowest rank's checkpoint load in `attempt-NNNN.log`, None when nothing was loaded."""
    try:
        text = (Path(log_dir) / f"attempt-{attempt:04d}.log").read_text(errors="replace")
    except FileNotFoundError:
        return None
    found = load_durations(text)
    return max(found) if found else None


def median(values: Sequence[float | None]) -> float | None:
    got = sorted(v for v in values if v is not None)
    if not got:
        return None
    mid = len(got) // 2
    return got[mid] if len(got) % 2 else (got[mid - 1] + got[mid]) / 2


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]
