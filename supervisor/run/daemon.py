"""`ftsup run`: the long-running loop that feeds the policy events and carries out its actions.

It decides nothing the policy could decide and never imports torch; how a tick goes, how it starts and stops, and
what an error means once it runs: docs/design/run-loop.md, The loop.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from ftsup.store import layout
from ftsup.store.errors import os_words
from ftsup.supervisor import statedir
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.durable.keeper import DurableKeeper
from ftsup.supervisor.errors import ConfigError, error_line
from ftsup.supervisor.eviction.requeue import requeue
from ftsup.supervisor.policy import goodput, nodes, saves
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.policy.anomaly import AnomalyState
from ftsup.supervisor.policy.events import (
    CaptureEvidence,
    CheckpointCommitted,
    EvidenceCaptured,
    WriteJournal,
    settings_from,
)
from ftsup.supervisor.run import systemd
from ftsup.supervisor.run.admission import Admission
from ftsup.supervisor.run.forensics import Forensics
from ftsup.supervisor.run.journaling import JournalKeeper, exit_status
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.run.resume import ResumeChoice
from ftsup.supervisor.run.sources import EventSources
from ftsup.supervisor.run.workers import Workers
from ftsup.supervisor.state.captures import CaptureWatcher
from ftsup.supervisor.state.journal import JournalRecord
from ftsup.supervisor.state.rollbacks import RollbackWatcher
from ftsup.supervisor.telemetry import logs
from ftsup.supervisor.telemetry.metrics import Metrics, MetricsServer

TICK_S = 0.1
GOODPUT_PERSIST_S = 0.25  # how often the time accounting is journaled (not fsynced) and exported while it moves on
FINAL_DURABLE_WAIT_S = 600.0  # the longest a finished job waits for its final checkpoint to be durable

log = structlog.get_logger("ftsup.supervisor")


class Daemon:
    def __init__(self, cfg: JobConfig, *, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.node_dir = Path(cfg.job.state_dir)
        self.log_dir = Path(cfg.logging.dir) if cfg.logging.dir else self.node_dir / "logs"
        self.metrics = Metrics(cfg.job.run_id, cfg.launch.node_id, started_unix=time.time())
        self.metrics_server: MetricsServer | None = None
        self.state = policy.State()  # the policy's, as of the last event fed
        self.goodput = goodput.Accounting()  # the job's time accounting, fed the policy's states (`goodput`)
        self._journaled: tuple[float, float | None, str] = (-float("inf"), None, "")  # when, cursor, activity
        self.pending: list[policy.Event] = []  # for the policy, oldest first
        self.code: int | None = None  # the exit status, once the loop runs
        self.durable_reached: bool | None = None  # whether an eviction's checkpoint became durable; None: not waited
        self.emergency_tiers: dict[str, Any] | None = None  # the tiers an eviction's checkpoint reached, journaled
        self.crash: str | None = None  # the line for stderr when the loop ended on a bug
        self.outages = Outages(self._emit, self.metrics.storage_error, clock)
        post, emit = self.pending.append, self._emit
        self.admission = Admission(cfg, emit=emit, metrics=self.metrics, outages=self.outages)  # this node joins?
        self.resume = ResumeChoice(
            cfg, emit=emit, post=post, outages=self.outages, metrics=self.metrics, admission=self.admission
        )
        self.durable = (
            DurableKeeper(cfg, emit=emit, metrics=self.metrics, clock=clock)
            if cfg.checkpoint.durable is not None
            else None
        )
        self.sources = EventSources(
            cfg,
            clock=clock,
            emit=emit,
            dropped=self.metrics.heartbeats_dropped,
            state_bytes=self.resume.latest_bytes,
            upload_s=self.durable.estimate_s if self.durable else None,
        )
        self.settings: policy.Settings | None = None
        self.journal = JournalKeeper(
            cfg,
            self.node_dir / "journal.json",
            self._journal_record,
            outages=self.outages,
            emit=emit,
            written=self._journaled_goodput,
        )
        self.workers = Workers(
            cfg,
            self.log_dir,
            clock=clock,
            emit=emit,
            post=post,
            outages=self.outages,
            journal=self.journal.write,
            figures=self.metrics.heartbeat,
        )
        self.rollbacks = RollbackWatcher(self.node_dir, clock=clock, emit=emit)
        self.captures = CaptureWatcher(self.node_dir, clock=clock, emit=emit, wall=time.time)  # an operator's capture
        self.forensics = Forensics(cfg, self.node_dir, clock=clock, emit=emit, outages=self.outages)

    def run(self) -> int:
        """Supervise the job until it ends; returns the exit status."""
        with contextlib.ExitStack() as stack:
            self._start(stack)  # raises, having released what it started, when something cannot start
            self.code = policy.EXIT_INTERNAL  # from here on, the log ends with supervisor_exited
            try:
                server = self.metrics_server.address if self.metrics_server else None
                self._emit(
                    "info",
                    "supervisor_started",
                    run_id=self.cfg.job.run_id,
                    node_id=self.cfg.launch.node_id,
                    pid=os.getpid(),
                    config=self.cfg.source,
                    metrics=server,
                    instrument=self.cfg.launch.instrument,
                    heartbeat_mode=str(self.cfg.heartbeat.mode),
                )
                adopted = self.journal.adopt()
                self.admission.adopt()  # a node quarantined by a previous supervisor stays out
                systemd.notify("READY=1", f"STATUS=supervising {self.cfg.job.run_id}")
                self.settings = settings_from(self.cfg, self.resume.nproc_max())
                # Attempt numbers go on from the journal: log files and FTSUP_ATTEMPT stay unique; so do the
                # data skips in force and the rollback requests served.
                kept = self.journal.kept
                anomaly = AnomalyState(skips=kept.skips, served=kept.rollbacks_served) if kept else AnomalyState()
                saved = goodput.Saved.from_json(kept.goodput) if kept and kept.goodput else None
                self.goodput = goodput.resumed(saved, kept.status if kept else None, self.clock(), time.time())
                self.state = policy.State(attempt_no=adopted, anomaly=anomaly)
                self.pending += [*self.rollbacks.poll(), policy.Start()]  # a request found now is the first start
                while True:
                    while self.pending:  # feed the events, carry out the actions
                        if (code := self._feed(self.pending.pop(0))) is not None:
                            self.code = code
                            return code
                    when, cursor, doing = self._journaled
                    if self.goodput.activity != doing or (
                        self.goodput.cursor != cursor and self.clock() - when >= GOODPUT_PERSIST_S
                    ):
                        # The accounting moved on: a supervisor restarted after this one's death goes on from here.
                        self.journal.write(durable=False)
                    self.outages.run_due()
                    self.resume.refresh_metrics()
                    if self.durable is not None:  # what the scan found committed goes durable, off this loop
                        self.durable.observe(self.resume.store.view())
                        self.durable.poll()
                    self.sources.wait(TICK_S)
                    self.pending.extend(self.sources.events())  # signals, eviction notices
                    self.pending.extend(self.rollbacks.poll())
                    if self.admission.poll():  # an operator cleared this node's quarantine: ask again now
                        self.resume.admit_now()
                    self.pending.extend(self.captures.poll())
                    beats = self.sources.beats(admit=self.workers.admits, vet=self.workers.vet)
                    self.pending.extend(self.workers.beats(beats))
                    self.pending.extend(self.workers.watch())  # torchrun's exit, a rank gone, new ranks
                    self.pending.append(policy.Tick(self.workers.states()))  # what tells a stopped rank
            except Exception as e:
                # What is expected (outages, failed launches) is handled where it happens; this is a bug. Exit
                # status 1 is restarted by systemd, and the new supervisor adopts the journal.
                what = "I/O error" if isinstance(e, OSError) else "internal error"  # an I/O error not ridden out
                self.crash = f"{what}: {error_line(e)} (traceback in {self.log_dir / 'supervisor.jsonl'})"
                self._emit(
                    "error", "supervisor_crashed", reason=f"{what}: {error_line(e)}", traceback=traceback.format_exc()
                )
                return self.code

    def _start(self, stack: contextlib.ExitStack) -> None:
        """Start every resource, each entered on `stack` as soon as it exists, so that a failure at any point
        releases exactly what was started. A state directory that is not safe or is another supervisor's, and a
        metrics address that cannot be served, are refused (exit 2); an I/O error is exit 1."""
        self.node_dir = statedir.ensure_dir(self.node_dir, "job.state_dir")
        stack.enter_context(contextlib.closing(statedir.InstanceLock(self.node_dir)))  # before the journal is read
        if (kept := self.journal.peek()) is not None:  # from the first scrape on, no counter lower than journaled
            self._journaled_goodput(kept)
        statedir.ensure_dir(self.log_dir, "logging.dir" if self.cfg.logging.dir else "job.state_dir")
        runtime = statedir.RuntimeDir.make(self.node_dir, os.environ)  # systemd's RuntimeDirectory, if any
        stack.callback(runtime.remove)
        logfile = logs.configure(self.cfg.logging.level, self.cfg.logging.format, self.log_dir / "supervisor.jsonl")
        if logfile is not None:
            stack.callback(logfile.close)
        stack.callback(self._log_exit)  # the log's last line, once everything after it is released
        if (server := self._serve_metrics()) is not None:
            self.metrics_server = stack.enter_context(contextlib.closing(server))
        stack.enter_context(self.sources.running(runtime.path))
        stack.callback(systemd.notify, "STOPPING=1")
        stack.enter_context(self.resume.running())
        if self.durable is not None:  # closed after the workers are stopped: what was sent is kept
            stack.enter_context(self.durable.running())
        stack.callback(self.forensics.close)  # after the workers are stopped: a capture thread ends by its bound
        stack.enter_context(self.workers.running(runtime.path))

    def _serve_metrics(self) -> MetricsServer | None:
        listen = self.cfg.metrics.listen
        if listen is None:
            return None
        try:
            return MetricsServer(self.metrics, listen)
        except OSError as e:
            raise ConfigError(
                f"metrics.listen={listen!r}: cannot serve /metrics there ({os_words(e)}); choose a free port "
                "(0 picks one) or set it to null"
            ) from None

    def _log_exit(self) -> None:
        if self.code is not None:
            self._emit("info", "supervisor_exited", code=self.code)

    def _feed(self, event: policy.Event) -> int | None:
        """Feed one event to the policy and the accountant and carry out its actions; the exit status at an Exit."""
        assert self.settings is not None
        now, before = self.clock(), self.state
        self.state, actions = policy.step(self.settings, before, event, now)
        self.goodput = goodput.feed(self.goodput, before, self.state, event, now)
        self.metrics.state(self.state, self.settings, now, time.time())
        ran = before.attempt.number if before.attempt is not None else None
        for fault in nodes.faults(before.phase, self.state.phase, ran, event):  # failures put on this node
            self.admission.fault(fault)
        self.admission.observe(self.state, self.settings)
        found = self.state.anomaly.incident
        if found is not None and (old := before.anomaly.incident) is not found:  # an anomaly's own record
            if old is None or replace(old, resumed_from=None) != replace(found, resumed_from=None):
                self.forensics.anomaly(found, self.state.attempt_no)
        return self._execute(actions)

    def _execute(self, actions: list[policy.Action]) -> int | None:
        """Carry out the policy's actions in order; the exit status once one of them is an Exit."""
        for action in actions:
            if isinstance(action, policy.Log):
                self._emit(action.level, action.event, **action.as_dict())
            elif isinstance(action, CheckpointCommitted):
                if self.durable is not None:
                    self.durable.saved(action.step, action.kind, fallback=action.fallback)
            elif isinstance(action, WriteJournal):
                self.journal.write("running")
            elif isinstance(action, policy.PrepareLaunch):
                self.resume.prepare_or_retry(action.attempt, action.at_most)
            elif isinstance(action, policy.Launch):
                self.workers.launch_or_fail(action)
            elif isinstance(action, CaptureEvidence):
                att = self.workers.attempt
                targets = self.workers.targets() if att is not None and att.number == action.attempt else []
                ranklog = att.log_path if att is not None else None
                if action.trigger != "hang":  # it stops nothing: the loop goes on beside it
                    self.forensics.capture_aside(action, targets, ranklog)
                    continue
                self.forensics.capture(action, targets, ranklog)  # its bound is its longest pause of the loop
                if (code := self._feed(EvidenceCaptured(action.attempt))) is not None:  # before the stop it held
                    return code
            elif isinstance(action, policy.StopWorkers):
                self.workers.stop(action)
            elif isinstance(action, policy.RequestSave):
                self.workers.request_save_or_retry(action)
            elif isinstance(action, policy.AckEviction):
                self.sources.ack(action.source)
            elif isinstance(action, policy.Exit):
                code = self._durable_before_exit(action)
                self._tiers_reached(code)
                self.journal.write(exit_status(code))
                if code in (policy.EXIT_EVICTED, policy.EXIT_SAVE_LOST):  # evicted either way: resumed elsewhere
                    requeue(self.cfg.eviction.requeue_command, os.environ, self._emit)
                return code
        return None

    def _durable_before_exit(self, action: policy.Exit) -> int:
        """With a durable tier, an eviction exits 5 once its checkpoint is durable, or at its deadline saying which
        checkpoint is the newest durable one; a finished job waits for what was picked (its final checkpoint's
        upload, and the ones before it still waiting). Returns the exit status: a finished job whose final
        checkpoint did not become durable there exits `EXIT_NOT_DURABLE`, not 0; an eviction whose checkpoint is
        only in the fallback directory, which nothing reads, exits `EXIT_SAVE_LOST` (`saves.not_durable`), not 5."""
        code = action.code
        if self.durable is None:
            return code
        margin = self.settings.stop_margin_s if self.settings is not None else 1.0
        if code == policy.EXIT_EVICTED and self.durable.tier_cfg.emergency:
            ej = self.state.eviction
            left = ej.deadline - self.clock() - margin if ej is not None else 0.0
            durable = self.durable.wait_durable(ej.committed_step if ej is not None else None, left, "evicted")
            self.durable_reached = durable
            if ej is not None and ej.fallback and not durable:
                st = self.state
                said, lost = saves.not_durable(ej, action, st.attempt_no, st.newest_checkpoint, st.best_step)
                self._execute(said)
                return lost.code
        elif code == policy.EXIT_OK and self.durable.tier_cfg.final and self.state.best_step >= 0:
            final_dir = Path(self.cfg.checkpoint.dir) / layout.step_dirname(self.state.best_step)
            if final_dir.is_dir():
                self.durable.submit(final_dir, urgent=True)
                if not self.durable.wait_idle(FINAL_DURABLE_WAIT_S, "the job finished", self.state.best_step):
                    return policy.EXIT_NOT_DURABLE
        return code

    def _tiers_reached(self, code: int) -> None:
        """An eviction's exit: log (and count, and journal) the tiers its emergency checkpoint reached."""
        ej = self.state.eviction
        if ej is None or code not in (policy.EXIT_EVICTED, policy.EXIT_SAVE_LOST):
            return
        said = saves.tiers_reached(ej, self.state.attempt_no, self.state.best_step, self.durable_reached)
        if said is not None:
            self._execute([said])
            self.emergency_tiers = dict(said.fields)

    def _emit(self, level: str, event: str, **fields: Any) -> None:
        """Log an event and count it: every log event goes through here, so metrics and logs agree."""
        try:
            getattr(log, level)(event, **fields)
        except OSError:  # the log file (stderr got the line first); logging that would fail the same way
            self.metrics.storage_error("log_file")
        self.metrics.event(event, fields)

    def _journaled_goodput(self, rec: JournalRecord) -> None:
        """Export the accounting `rec` holds once it is on disk: a restarted supervisor, which goes on from the
        journal, then never exports a counter lower than this one did."""
        if rec.goodput is not None:
            self.metrics.accounting(goodput.Saved.from_json(rec.goodput).totals)

    def _journal_record(self, status: str) -> JournalRecord:
        """What a restarted supervisor (or `ftsup status`) needs to know, as of now."""
        st, att, launched = self.state, self.workers.attempt, self.state.last_launch
        now = self.clock()
        accounted = goodput.snapshot(self.goodput, now, time.time())
        self._journaled = (now, self.goodput.cursor, self.goodput.activity)
        latest = self.resume.latest()  # as last scanned
        extra: dict[str, Any] = {"latest_checkpoint": latest.step if latest else None}
        if self.metrics_server is not None:
            extra["metrics"] = self.metrics_server.address
        if self.durable is not None:
            extra["durable"] = self.durable.status()
        if self.emergency_tiers is not None:
            extra["emergency_tiers"] = self.emergency_tiers
        if self.sources.noticed:
            extra["eviction"] = [
                {"source": n.source, "deadline_unix": n.deadline_unix, "detail": n.detail}
                for n in self.sources.noticed.values()
            ]
        return JournalRecord(
            run_id=self.cfg.job.run_id,
            node_id=self.cfg.launch.node_id,
            supervisor_pid=os.getpid(),
            attempt=att.number if att else launched.attempt if launched else self.journal.adopted,
            world_size=launched.nproc if launched else None,
            resume_step=launched.resume_step if launched else None,
            # Only processes of the attempt (its tree, its mark): a pid claimed in a heartbeat is not journaled.
            pids=tuple(sorted({p.pid for p in att.tree()})) if att else (),
            attempt_started_unix=att.started_at if att else None,
            last_failure=st.last_failure,
            status=status,
            updated_unix=time.time(),
            extra=extra,
            skips=st.anomaly.skips,
            rollbacks_served=st.anomaly.served,
            incident=st.anomaly.incident.to_json() if st.anomaly.incident else None,
            stragglers=st.anomaly.health.stragglers,
            goodput=accounted.to_json(),
        )
