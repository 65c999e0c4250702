"""Carries out the policy's `CaptureEvidence`: every rank's stacks, process state, last heartbeat and log lines and
NCCL's flight recorder, captured in parallel within a hard bound, the culprit named, the incident record written
(docs/incidents.md, Hangs: the evidence before the kill). It never blocks past its bound, nor fails the stop after it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ftsup import procs
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.errors import SupervisorError, error_line
from ftsup.supervisor.policy import stacks
from ftsup.supervisor.policy.anomaly import Incident as Anomaly
from ftsup.supervisor.policy.events import CaptureEvidence
from ftsup.supervisor.policy.hangs import GONE, STUCK
from ftsup.supervisor.policy.stacks import Thread
from ftsup.supervisor.run import flightrec, ranklogs, stacktools
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.state import incidents

WRITE_MARGIN_S = 0.25  # of the bound, kept for the record's write after the stacks
JOIN_S = 1.0  # at close, the longest waited for each capture thread still running
CONTINUED = "continued: a stack tool stopped at the bound had left it stopped"


@dataclass(frozen=True)
class Target:
    """A rank of the running attempt, as the heartbeat channel admitted it and as last heard."""

    rank: int
    local_rank: int
    pid: int
    start_ticks: int | None = None  # its start time as first read (`procs.run_state`): a later process is not it
    step: int | None = None
    phase: str | None = None
    beat_unix: float | None = None


@dataclass
class _Taken:
    """One rank's capture, filled in by its thread: what failed is appended as it is known."""

    threads: list[Thread] = field(default_factory=list)
    tool: str | None = None
    problems: list[str] = field(default_factory=list)
    done: bool = False
    held: bool = False  # a tool that stops the rank to read it was killed before it let go


class Forensics:
    def __init__(
        self,
        cfg: JobConfig,
        state_dir: Path,
        *,
        clock: Callable[[], float],
        emit: Callable[..., None],
        outages: Outages,
        environ: dict[str, str] | None = None,
    ) -> None:
        """`emit(level, event, **fields)` logs an event; `environ` is where the stack tools are looked up (PATH)."""
        self.cfg = cfg
        self.store = incidents.Store(state_dir)
        self.state_dir = Path(state_dir)
        self._clock = clock
        self._emit = emit
        self._outages = outages
        self._environ = dict(os.environ if environ is None else environ)
        self._threads: list[threading.Thread] = []
        self._aside: threading.Thread | None = None  # a capture that stops nothing, under way (`capture_aside`)

    def close(self) -> None:
        """Wait (a little) for capture threads still running: each ends at its own deadline, its tool killed."""
        self._wait_aside()
        for t in self._threads:
            t.join(JOIN_S)
        self._threads = []

    # ------------------------------------------------------------------ the capture

    def capture(
        self, action: CaptureEvidence, targets: Sequence[Target], attempt_log: Path | None
    ) -> incidents.Incident | None:
        """Capture, name the culprit and write the record, all within `action.timeout_s`; the record (None: it could
        not be written, which is logged and counted, never raised). A capture under way aside is waited for first."""
        self._wait_aside()
        return self._guarded(action, targets, attempt_log)

    def capture_aside(self, action: CaptureEvidence, targets: Sequence[Target], attempt_log: Path | None) -> None:
        """A capture that stops nothing (a straggler's, an operator's) on a thread of its own, so that the loop goes
        on meanwhile (an eviction notice is not held up by it). One at a time: one asked for meanwhile is not taken,
        which is logged."""
        if self._aside is not None and self._aside.is_alive():
            why = f"the {action.trigger} capture is not taken: another capture is under way"
            self._emit("warning", "incident_failed", attempt=action.attempt, reason=why)
            return
        self._aside = threading.Thread(
            target=self._guarded, args=(action, targets, attempt_log), name="ftsup-evidence", daemon=True
        )
        self._aside.start()

    def _wait_aside(self) -> None:
        if self._aside is not None:
            self._aside.join(self.cfg.forensics.timeout_s + JOIN_S)  # it ends by its own bound
            self._aside = None

    def _guarded(
        self, action: CaptureEvidence, targets: Sequence[Target], attempt_log: Path | None
    ) -> incidents.Incident | None:
        try:
            return self._capture(action, targets, attempt_log)
        except Exception as e:  # an adapter's boundary: a capture that fails must never hold back the stop after it
            self._emit("error", "incident_failed", attempt=action.attempt, reason=error_line(e))
            return None

    def _capture(
        self, action: CaptureEvidence, targets: Sequence[Target], attempt_log: Path | None
    ) -> incidents.Incident | None:
        t0, wall = self._clock(), time.time()
        bound = max(0.1, action.timeout_s)
        stacks_until = t0 + bound - min(WRITE_MARGIN_S, bound / 10)
        tools_until = stacks_until - min(stacktools.REAP_S, bound / 10)  # a tool stopped there is reaped by then
        incident_id = incidents.new_id(action.trigger, action.attempt, wall)
        self._threads = [t for t in self._threads if t.is_alive()]
        before = {t.local_rank: self._state(t) for t in targets}  # before any tool stops a process to read it
        states: dict[int, str | None] = {local: state for local, (state, _) in before.items()}
        wchans = {t.local_rank: stacktools.wchan(t.pid) for t in targets if states[t.local_rank] != GONE}
        stem = flightrec.prefix(self.state_dir, action.attempt)
        asked = flightrec.poke(stem, [t.rank for t in targets]) if self.cfg.forensics.nccl_flight_recorder else []
        tools, missing = stacktools.find_tools(self.cfg.forensics.tools, self._environ)
        taken = {t.local_rank: _Taken() for t in targets}
        workers = []
        for t in targets:
            if states[t.local_rank] == GONE:
                taken[t.local_rank] = _Taken(problems=["no process to read"], done=True)
                continue
            worker = threading.Thread(
                target=self._take,
                args=(taken[t.local_rank], t, before[t.local_rank], tools, tools_until),
                name=f"ftsup-evidence-{t.local_rank}",
                daemon=True,
            )
            worker.start()
            workers.append(worker)
        self._threads += workers
        for worker in workers:
            worker.join(max(0.0, stacks_until - self._clock()))
        got = {local: self._settled(taken[local], t) for local, t in ((t.local_rank, t) for t in targets)}
        for t in targets:  # a capture still running may hold its rank stopped: the stop found is taken for its tools'
            left = taken[t.local_rank]
            if (left.held or not left.done) and continue_left(t.pid, *before[t.local_rank]):
                got[t.local_rank].problems.append(CONTINUED)
        try:
            self.store.ensure()
            dumps, dump_problems = flightrec.collect(
                stem, [t.rank for t in targets], asked, stacks_until, self._clock, self.store, incident_id
            )
        except (OSError, ValueError, SupervisorError) as e:  # a directory refused is the record's outage, said there
            dumps, dump_problems = [], [f"NCCL dumps: {error_line(e)}"]
        ranks_dir = ranklogs.ranks_dir(attempt_log) if attempt_log is not None else None
        evidence = [self._evidence(t, states, wchans, got, missing, ranks_dir) for t in targets]
        seen = [stacks.Seen(r.rank, r.state, r.collective) for r in evidence]
        culprit, why = stacks.culprit(seen, action.rank, by_silence=action.trigger != "operator")
        if action.trigger == "straggler":
            culprit, why = action.rank, "reported as a straggler (its own work per step above the others')"
        took = round(self._clock() - t0, 3)
        incident = incidents.Incident(
            id=incident_id,
            trigger=action.trigger,
            event=action.event,
            created_unix=round(wall, 3),
            run_id=self.cfg.job.run_id,
            node_id=self.cfg.launch.node_id,
            attempt=action.attempt,
            reason=action.reason[: incidents.MAX_TEXT],
            step=action.step,
            culprit=culprit,
            culprit_why=why,
            blamed=action.rank,
            duration_s=took,
            timeout_s=action.timeout_s,
            complete=all(r.tool is not None for r in evidence),
            ranks=tuple(sorted(evidence, key=lambda r: r.rank)),
            nccl=tuple(dumps),
        )
        if dump_problems:
            incident = replace(incident, ranks=_with_problems(incident.ranks, dump_problems))
        return self._write(incident, level="warning" if action.trigger == "hang" else "info")

    def anomaly(self, found: Anomaly, attempt: int, wall: float | None = None) -> incidents.Incident | None:
        """An anomaly or an operator's rollback (`policy.anomaly.Incident`) as an incident record of its own."""
        wall = time.time() if wall is None else wall
        incident = incidents.Incident(
            id=incidents.new_id("anomaly", attempt, wall),
            trigger="anomaly",
            event="anomaly_detected" if found.kind != "operator" else "rollback_requested",
            created_unix=round(wall, 3),
            run_id=self.cfg.job.run_id,
            node_id=self.cfg.launch.node_id,
            attempt=attempt,
            reason=found.reason[: incidents.MAX_TEXT],
            step=found.step,
            culprit_why="",
            anomaly=found.to_json(),
        )
        return self._write(incident, level="info")

    def _write(self, incident: incidents.Incident, *, level: str) -> incidents.Incident | None:
        try:
            pruned = self.store.write(incident, self.cfg.forensics.keep)
        except (OSError, SupervisorError) as e:  # the directory refused (a link, a file), or the record
            self._outages.failed("incidents", self.store.dir, e)
            return None
        except Exception as e:  # an adapter's boundary: a record that cannot be made must never stop the stop
            self._emit("error", "incident_failed", attempt=incident.attempt, reason=error_line(e))
            return None
        self._outages.ok("incidents")
        self._emit(
            level,
            "incident_recorded",
            attempt=incident.attempt,
            id=incident.id,
            trigger=incident.trigger,
            rank=incident.culprit,
            reason=incident.culprit_why or incident.reason,
            step=incident.step,
            duration_s=incident.duration_s,
            complete=incident.complete,
            path=str(self.store.path(incident.id)),
            pruned=len(pruned),
        )
        return incident

    def _state(self, t: Target) -> tuple[str, int | None]:
        """The rank's process state and start time; `GONE` when the pid names no process, or a later one (then it is
        never read nor signalled as this rank)."""
        got = procs.run_state(t.pid)
        if got is None or (t.start_ticks is not None and got[1] != t.start_ticks):
            return GONE, None
        return got

    def _take(
        self, out: _Taken, t: Target, before: tuple[str, int | None], tools: Sequence[stacktools.Tool], until: float
    ) -> None:
        try:
            out.threads, out.tool, out.held = stacktools.take(tools, t.pid, before[0], until, self._clock, out.problems)
        except Exception as e:  # a thread of this adapter: what failed is said in the record, never raised
            out.problems.append(f"capture failed: {error_line(e)}")
            out.held = True  # its tools' fate unknown: a stop found is taken for theirs
        # Its tools are gone: even past the bound, a rank a tool left stopped is never left so. A stop that came while
        # every tool let go of it on its own is someone else's (an operator, a scheduler's suspend): it stays.
        if out.held and continue_left(t.pid, *before):
            out.problems.append(CONTINUED)
        out.done = True

    def _settled(self, taken: _Taken, t: Target) -> _Taken:
        """What a rank's capture holds at the bound: its stacks, else the kernel's view (each thread's state and where
        it waits) with what failed; a thread still running adds nothing after this."""
        threads, tool = (taken.threads, taken.tool) if taken.done else ([], None)
        problems = list(taken.problems) + ([] if taken.done else ["no stack within the bound"])
        if not threads and "no process to read" not in problems:
            threads = stacktools.kernel_threads(t.pid)
        return _Taken(list(threads), tool, problems, True)

    def _evidence(
        self,
        t: Target,
        states: dict[int, str | None],
        wchans: dict[int, str | None],
        got: dict[int, _Taken],
        missing: list[str],
        ranks_dir: Path | None,
    ) -> incidents.RankEvidence:
        taken = got[t.local_rank]
        state = states.get(t.local_rank)
        tail = tuple(ranklogs.rank_output(ranks_dir, t.local_rank)) if ranks_dir is not None else ()
        return incidents.RankEvidence(
            rank=t.rank,
            local_rank=t.local_rank,
            pid=t.pid,
            state=state,
            wchan=wchans.get(t.local_rank),
            threads=tuple(taken.threads),
            tool=taken.tool,
            problems=tuple([*missing, *taken.problems][: incidents.MAX_PROBLEMS]),
            collective=stacks.in_collective(taken.threads) if taken.tool else None,
            step=t.step,
            phase=t.phase,
            beat_unix=t.beat_unix,
            log_tail=tuple(line[: incidents.MAX_TEXT] for line in tail[-incidents.MAX_LINES :]),
        )


def continue_left(pid: int, state: str, ticks: int | None) -> bool:
    """Continue the rank `pid` if a stack tool left it stopped: stopped now (`T`), though it was not when first read
    (`state`), and still the process it was (its start time `ticks`): a tool stopped at its deadline while it held
    the rank stopped to read it can leave it so (the SIGSTOP of its attach outlives it). Whether it was continued."""
    now = procs.run_state(pid)
    if state in STUCK or ticks is None or now != ("T", ticks):
        return False
    try:
        os.kill(pid, signal.SIGCONT)  # the rank as it was: verified by its start time
    except ProcessLookupError:
        return False
    return True


def _with_problems(ranks: Sequence[incidents.RankEvidence], problems: list[str]) -> tuple[incidents.RankEvidence, ...]:
    """NCCL dump problems, said on the rank they are about (`rank N's NCCL dump: ...`)."""
    out = []
    for r in ranks:
        mine = [p for p in problems if p.startswith(f"rank {r.rank}'s ")]
        out.append(replace(r, problems=(*r.problems, *mine)[: incidents.MAX_PROBLEMS]) if mine else r)
    return tuple(out)
