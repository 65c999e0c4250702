"""Whether this node joins the next attempt: its quarantine (kept in the state directory, cleared by the operator) and
its checks, run before every attempt. A node held out does not start torchrun; it says why and checks again later
(docs/design/run-loop.md, Node health and quarantine).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from ftsup.supervisor import statedir
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.policy import nodes
from ftsup.supervisor.run import capped, nodehealth
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.state import nodes as nodefiles
from ftsup.supervisor.telemetry.metrics import Metrics

POLL_S = 0.5  # how often the clear request file is looked at


def when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


class Admission:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        emit: Callable[..., None],
        metrics: Metrics,
        outages: Outages,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        check: Callable[[JobConfig, capped.Ran | None], nodes.Verdict] = nodehealth.check,
    ) -> None:
        """`emit(level, event, **fields)` logs an event; `clock` is the loop's, `wall` the Unix time that the
        quarantine is kept in (it outlives this supervisor); `check` runs this node's checks."""
        self.cfg = cfg
        self.state_dir = Path(cfg.job.state_dir)
        self.rules = nodes.Rules.of(cfg.launch)
        self.book = nodes.Book()
        self.verdict: nodes.Verdict | None = None  # the last checks
        self.waiting: str | None = None  # why the next attempt waits, None: it does not
        self._emit = emit
        self._metrics = metrics
        self._outages = outages
        self._clock = clock
        self._wall = wall
        self._check = check
        self._deferred = 0  # launches deferred in a row for failed checks (their backoff)
        self._retry_unix: float | None = None
        self._standby: str | None = None
        self._checked_unix: float | None = None  # when `verdict` was found
        self._next_poll = -float("inf")
        self._clear_mark: tuple[int, ...] | None = None

    @property
    def quarantine_path(self) -> Path:
        return self.state_dir / nodefiles.QUARANTINE

    # ------------------------------------------------------------------ the daemon's start

    def adopt(self) -> None:
        """Take up the quarantine a previous supervisor journaled. A file that is not one (a link, too large, not
        JSON, another schema) is said, naming it and what is wrong, and moved aside; the node starts with none."""
        try:
            book = nodefiles.read(self.quarantine_path)
        except nodefiles.NodeFileError as e:
            kept = self._set_aside(self.quarantine_path)
            self._emit("error", "quarantine_ignored", path=str(self.quarantine_path), reason=str(e), kept=kept)
            book = None
        self.book = book or nodes.Book()
        held = nodes.held(self.book, self._wall())
        self._metrics.node_quarantined(held is not None)
        if held is not None and held.until is not None:
            self._emit(
                "warning",
                "node_quarantined",
                target=nodes.NODE,
                until_unix=held.until,
                reason=f"still quarantined from before, until {when(held.until)}: {held.reason}",
            )

    def _set_aside(self, path: Path) -> str | None:
        """Rename a bad file of ours out of the way (kept for a person to read; a link is moved, never followed)."""
        aside = path.with_name(f"{path.name}.invalid-{int(self._wall())}")
        try:
            os.rename(path, aside)
        except OSError:
            return None
        return str(aside)

    # ------------------------------------------------------------------ before each attempt

    def admit(self, attempt: int) -> tuple[capped.Ran | None, float | None]:
        """Before attempt `attempt`: (how `launch.health_command` ran, for the slot count; None when none is set
        or the node is held), and None when the node joins, else the seconds until it asks again."""
        now = self._wall()
        self._expire(now)
        held = nodes.held(self.book, now)
        if held is not None and held.until is not None:
            why = f"this node is quarantined until {when(held.until)} ({held.reason}); `ftsup nodes clear` lets it in"
            return None, self._defer(attempt, why, held.until - now)
        ln = self.cfg.launch
        ran = capped.run(ln.health_command, ln.health_timeout_s) if ln.health_command else None
        verdict = self.verdict = self._check(self.cfg, ran)
        self._checked_unix = self._wall()
        self._metrics.node_checked(verdict)
        self._emit(
            "info" if verdict.healthy is not False else "warning",
            "node_checked",
            attempt=attempt,
            healthy=verdict.healthy,
            reason=verdict.reason or None,
            checks={c.name: {"result": c.result, "detail": c.detail} for c in verdict.checks},
        )
        if verdict.healthy is False:
            self._deferred += 1
            backoff = ln_backoff(self.cfg, self._deferred)
            return ran, self._defer(attempt, f"node checks failed: {verdict.reason}", backoff)
        self._deferred, self.waiting, self._retry_unix = 0, None, None
        self._write_view()
        return ran, None

    def _defer(self, attempt: int, why: str, wait_s: float) -> float:
        wait_s = max(0.0, wait_s)
        self.waiting, self._retry_unix = why, self._wall() + wait_s
        self._emit("warning", "launch_deferred", attempt=attempt, reason=why, retry_in_s=round(wait_s, 3))
        self._write_view()
        return wait_s

    def _expire(self, now: float) -> None:
        self.book, ended = nodes.expire(self.book, now)
        if ended is not None:
            self._emit("info", "quarantine_expired", target=ended.target, reason=f"quarantined since {ended.reason}")
            self._journal()
        self._metrics.node_quarantined(nodes.held(self.book, now) is not None)

    # ------------------------------------------------------------------ failures, clears

    def fault(self, fault: nodes.NodeFault) -> None:
        """Count a failure the policy put on this node (`nodes.faults`); quarantine it when they add up."""
        now = self._wall()
        self.book, node, quarantined = nodes.record(self.rules, self.book, fault, now)
        self._emit(
            "info",  # the failure itself is said once, as the attempt's (`worker_exited`)
            "node_fault_recorded",
            attempt=fault.attempt,
            target=nodes.slot(fault.local_rank),
            reason=fault.reason,
            failures=len(node.faults) if not quarantined else self.rules.failures,
            limit=self.rules.failures or None,
        )
        if quarantined and node.until is not None:
            self._emit(
                "error",
                "node_quarantined",
                attempt=fault.attempt,
                target=nodes.NODE,
                until_unix=node.until,
                reason=f"{self.rules.failures} failures within {self.rules.window_s:g}s, the last: {fault.reason}; "
                f"out of later attempts until {when(node.until)}",
            )
            self._metrics.node_quarantined(True)
        self._journal()

    def poll(self) -> bool:
        """Serve an operator's clear request (`ftsup nodes clear`) when one came; True when it ended a quarantine or
        may let a waiting launch go, so that the caller asks again now."""
        now = self._clock()
        if now < self._next_poll:
            return False
        self._next_poll = now + POLL_S
        path = self.state_dir / nodefiles.CLEAR
        try:
            mark = statedir.mark(path)
        except OSError:
            mark = ()
        if mark == self._clear_mark or not mark:
            self._clear_mark = mark
            return False
        self._clear_mark = mark
        try:
            req = nodefiles.read_clear(path)
        except nodefiles.NodeFileError as e:
            self._emit("warning", "quarantine_clear_ignored", path=str(path), reason=str(e))
            return False
        if req is None:
            return False
        return self.clear(req)

    def clear(self, req: nodefiles.ClearRequest) -> bool:
        if req.id in self.book.served:
            return False  # served already (by this supervisor, or by `ftsup nodes clear` while none ran)
        self.book, gone = nodes.clear(self.book, req.id, req.slots)
        self._emit("info", "quarantine_cleared", targets=gone, who=req.who, id=req.id, reason="an operator cleared it")
        self._journal()
        self._metrics.node_quarantined(nodes.held(self.book, self._wall()) is not None)
        return self.waiting is not None

    def _journal(self) -> None:
        # An I/O error is an outage: the quarantine is kept in memory, and the next change writes it again.
        write = lambda: nodefiles.write(self.quarantine_path, self.book, self.cfg.launch.node_id, self._wall())  # noqa: E731
        self._outages.guard("quarantine", self.quarantine_path, write)
        self._write_view()

    # ------------------------------------------------------------------ the node as `ftsup nodes` shows it

    def observe(self, st: policy.State, settings: policy.Settings) -> None:
        """A hot spare's role as the policy's state says it: "waiting" in the rendezvous (its attempt runs, its ranks
        have not started), "joined" (they have); None: neither, or no spare."""
        att = st.attempt
        role = None
        if settings.standby and att is not None and st.phase == policy.SupervisorPhase.RUNNING:
            role = "waiting" if att.ranks_at is None else "joined"
        if role != self._standby:
            self._standby = role
            self._write_view()

    def _write_view(self) -> None:
        verdict = self.verdict or nodes.Verdict(None, ())
        view = nodefiles.View(
            self.cfg.launch.node_id, self._checked_unix, verdict, self.waiting, self._retry_unix, self._standby
        )
        with contextlib.suppress(OSError):  # a view the next check rebuilds
            statedir.write_atomic(self.state_dir / nodefiles.VIEW, view.encode(), durable=False)


def ln_backoff(cfg: JobConfig, in_a_row: int) -> float:
    """The wait before a node that failed its checks `in_a_row` times checks again: the restart backoff's."""
    rs = cfg.restart
    return min(rs.backoff_max_s, rs.backoff_initial_s * 2 ** max(0, in_a_row - 1))
