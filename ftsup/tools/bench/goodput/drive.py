"""One contender's run of `ftsup bench goodput`: its launcher started, the schedule's faults delivered while the job
trains, what follows each seen from outside (the reaction, the relaunch, the first step again), a hang nobody ends
within `hang_cap_s` ended as its collective timeout would, and the run's `Timeline` for `account`. Whatever
happens, everything the run started is SIGKILLed and reaped before `drive` returns.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from ftsup.tools.bench.goodput.account import OTHER, Interruption, Line, Timeline
from ftsup.tools.bench.goodput.contenders import Contender
from ftsup.tools.bench.goodput.schedule import Fault
from ftsup.tools.faults import chaos
from ftsup.tools.faults.refjob import TrainerJob

POLL_S = 0.05
SETTLE_STEPS = 5  # steps a (re)launched job logs before a fault that came due meanwhile is delivered


@dataclass(frozen=True)
class Options:
    hang_cap_s: float
    evict_deadline_s: float
    timeout_s: float  # the whole run's, first launch to the end


@dataclass
class _Pending:
    """A fault (or an unexplained restart) from its delivery to the first step after the relaunch."""

    kind: str
    t: float
    fault: Fault | None = None
    due_t: float | None = None
    target: chaos.RankProcess | None = None
    pids: frozenset[int] = frozenset()
    step_before: int = 0  # the step the job was at (its latest line): behind its best while it redoes a rollback
    reacted_t: float | None = None
    relaunched_t: float | None = None
    recovered_t: float | None = None
    first_step: int | None = None
    capped: bool = False
    coalesced: list[Fault] = field(default_factory=list)

    def interruption(self, load_s: float | None) -> Interruption:
        return Interruption(
            self.t, self.kind, self.reacted_t, self.relaunched_t, load_s if self.relaunched_t is not None else None
        )

    def record(self, t0: float) -> dict[str, Any]:
        def since(x: float | None, base: float) -> float | None:
            return None if x is None else round(x - base, 3)

        return {
            "index": self.fault.index if self.fault else None,
            "kind": self.kind,
            "rank": self.target.rank if self.target else None,
            "due_s": since(self.due_t, t0),
            "delivered_s": since(self.t, t0),
            "deferred_s": since(self.t, self.due_t) if self.due_t else None,
            "detect_s": since(self.reacted_t, self.t),
            "relaunch_s": since(self.relaunched_t, self.t),
            "recover_s": since(self.recovered_t, self.t),
            "capped": self.capped,
            # steps logged before the fault and trained again (none when training went on past the notice)
            "lost_steps": None if self.first_step is None else max(0, self.step_before - (self.first_step - 1)),
            # an eviction whose checkpoint survived the node: the job resumed at or past the step of the notice
            "fired": None
            if self.kind != "evict"
            else self.first_step is not None and self.first_step > self.step_before,
            "survived": self.recovered_t is not None,
            "coalesced": [f.index for f in self.coalesced],
        }


@dataclass
class Run:
    """What one contender's run left: its timeline and what the table reports beside the arithmetic."""

    timeline: Timeline
    completed: bool
    exit_codes: list[int]
    launches: int
    faults: list[dict[str, Any]]
    ended_by: dict[str, Any] | None
    steps_logged: int
    orphans: list[str] = field(default_factory=list)


def drive(contender: Contender, job: TrainerJob, faults: Sequence[Fault], opts: Options) -> Run:
    contender.prepare(job)
    t0 = time.time()
    proc = contender.start(job, 1)
    procs = [proc]
    try:
        with chaos.LossLogTail(job.loss_log) as tail:
            run = _Loop(contender, job, faults, opts, t0, tail, procs).run()
    finally:
        for p in procs:
            chaos.stop_all(chaos.tree([p.pid]))
        chaos.stop_all(chaos.matching_processes(job.markers))
        for p in procs:
            _reap(p)
    left = chaos.matching_processes(job.markers)
    run.orphans = [chaos.describe(p) for p in left]
    chaos.stop_all(left)
    return run


class _Loop:
    def __init__(
        self,
        contender: Contender,
        job: TrainerJob,
        faults: Sequence[Fault],
        opts: Options,
        t0: float,
        tail: chaos.LossLogTail,
        procs: list[subprocess.Popen[bytes]],
    ) -> None:
        self.contender, self.job, self.opts, self.t0, self.tail, self.procs = contender, job, opts, t0, tail, procs
        self.queue = collections.deque(faults)
        self.cur: _Pending | None = None
        self.done: list[_Pending] = []
        self.known: frozenset[int] = frozenset()  # the ranks while no fault is in flight
        self.gone_since: float | None = None  # when one of `known` went without a fault of ours
        self.codes: list[int] = []
        self.since = t0  # the latest launch or relaunch
        self.clock: float | None = None  # the schedule's zero: the job's first step (docs/benchmarks.md, Goodput)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs[-1]

    def run(self) -> Run:
        while True:
            now = time.time()
            code = self.proc.poll()
            ranks = chaos.ranks_under(self.proc.pid) if code is None else {}
            pids = frozenset(r.pid for r in ranks.values())
            lines = self.tail.lines()
            if self.cur is not None:
                self._follow(self.cur, now, pids, lines)
            if code is not None:
                self.codes.append(code)
                if self.cur is not None and self.cur.kind == "evict" and not self._finished(lines, code):
                    self._requeue(self.cur)
                    continue
                return self._result(now, code, lines)
            if now - self.t0 > self.opts.timeout_s:
                return self._result(now, None, lines)
            if self.cur is None:
                self._watch_restarts(now, pids)
                self._deliver(now, ranks, lines)
            time.sleep(POLL_S)

    def _follow(self, cur: _Pending, now: float, pids: frozenset[int], lines: Sequence[chaos.LossLine]) -> None:
        if cur.reacted_t is None:
            others = cur.pids - {cur.target.pid} if cur.target else cur.pids
            if cur.kind != "evict" and others - pids:
                cur.reacted_t = now
            elif cur.kind == "hang" and not cur.capped and now - cur.t >= self.opts.hang_cap_s and cur.target:
                _signal(cur.target, signal.SIGKILL)  # what the collective timeout would do, hang_cap_s in
                cur.capped = True
            elif cur.kind == "evict" and now - cur.t >= self.opts.evict_deadline_s:
                chaos.stop_all(chaos.tree([self.proc.pid]))  # the deadline: the node is gone
        elif cur.relaunched_t is None:
            if cur.kind != "evict" and pids - cur.pids:
                cur.relaunched_t = now
        else:
            first = next((ln for ln in lines if ln.t > (cur.relaunched_t or now)), None)
            if first is not None:
                cur.recovered_t, cur.first_step = first.t, first.step
                self.since = cur.relaunched_t or now
                self.done.append(cur)
                self.cur = None
                self.known = frozenset()

    def _requeue(self, cur: _Pending) -> None:
        """The evicted job's launcher is gone: start it again at once, as a scheduler's requeue would."""
        if cur.reacted_t is None:
            cur.reacted_t = time.time()
        chaos.stop_all(chaos.matching_processes(self.job.markers))  # the node is gone, and all on it
        self.procs.append(self.contender.start(self.job, len(self.procs) + 1))
        cur.relaunched_t = time.time()

    def _watch_restarts(self, now: float, pids: frozenset[int]) -> None:
        """A restart no fault of ours explains: one of the known ranks gone, then new ones."""
        if self.gone_since is None and self.known - pids:
            self.gone_since = now
        if self.gone_since is not None and pids - self.known and len(pids) == self.job.nproc:
            other = _Pending(OTHER, self.gone_since, pids=self.known, reacted_t=self.gone_since, relaunched_t=now)
            other.step_before = self.tail.latest_step()
            self.cur, self.gone_since = other, None
        elif self.gone_since is None and len(pids) == self.job.nproc:
            self.known = pids

    def _deliver(self, now: float, ranks: dict[int, chaos.RankProcess], lines: Sequence[chaos.LossLine]) -> None:
        if self.clock is None and lines:
            self.clock = min(ln.t for ln in lines)
        if self.clock is None or not self.queue or now - self.clock < self.queue[0].at_s or self.gone_since is not None:
            return
        if len(ranks) != self.job.nproc or sum(1 for ln in lines if ln.t > self.since) < SETTLE_STEPS:
            return  # due, but the job is not training (yet): it waits
        fault = self.queue.popleft()
        merged = []  # also due by now: a job that is down is brought down once
        while self.queue and now - self.clock >= self.queue[0].at_s:
            merged.append(self.queue.popleft())
        pending = _Pending(
            fault.kind,
            0.0,
            fault=fault,
            due_t=self.clock + fault.at_s,
            pids=frozenset(r.pid for r in ranks.values()),
            step_before=self.tail.latest_step(),
            coalesced=merged,
        )
        if fault.kind == "evict":
            pending.t = time.time()
            self.proc.send_signal(signal.SIGTERM)
        else:
            pending.target = ranks[sorted(ranks)[fault.rank % len(ranks)]]
            sent = _signal(pending.target, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
            if sent is None:  # gone between the listing and the signal: try again at the next poll
                self.queue.extendleft(reversed([fault, *merged]))
                return
            pending.t = sent
        self.cur = pending

    def _finished(self, lines: Sequence[chaos.LossLine], code: int) -> bool:
        return code == 0 and len({ln.step for ln in lines}) >= self.job.steps

    def _result(self, now: float, code: int | None, lines: Sequence[chaos.LossLine]) -> Run:
        self.tail.close()
        lines = self.tail.lines()
        steps = {ln.step for ln in lines}
        completed = code == 0 and steps >= set(range(1, self.job.steps + 1))
        ended_by = None
        if not completed:
            reason = f"not finished within {self.opts.timeout_s:g} s" if code is None else f"the launcher exited {code}"
            fault = self.cur.record(self.t0) if self.cur is not None else None
            ended_by = {"reason": reason, "t_s": round(now - self.t0, 3), "fault": fault}
        loads = [x for path in self.contender.rank_logs(self.job) for x in chaos.load_durations(_text(path))]
        load_s = chaos.median(loads)
        pending = [*self.done, *([self.cur] if self.cur is not None else [])]
        timeline = Timeline(
            start=self.t0,
            end=now,
            lines=tuple(Line(ln.t, ln.step) for ln in lines),
            interruptions=tuple(p.interruption(load_s) for p in pending),
            save_every=self.job.ckpt_every,
        )
        return Run(
            timeline=timeline,
            completed=completed,
            exit_codes=self.codes,
            launches=len(self.procs),
            faults=[p.record(self.t0) for p in pending if p.fault is not None],
            ended_by=ended_by,
            steps_logged=len(steps),
        )


def _signal(rank: chaos.RankProcess, sig: int) -> float | None:
    """Signal a rank; when it was sent, or None when it is already gone."""
    try:
        return chaos.send(rank, sig)
    except (chaos.ChaosError, psutil.NoSuchProcess):  # gone before, or between its check and the signal
        return None


def _text(path: Any) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
