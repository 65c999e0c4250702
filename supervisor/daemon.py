"""`ftsup run`: the long-running loop that turns events into the policy's decisions and the
decisions into processes.

The loop waits (up to a tick) on signals and watchers, then feeds the policy: the heartbeats
read off the channel, torchrun's exit, a tick for timeouts. It carries out each action with the thin
adapters (launcher, health probe, checkpoint reader, journal) and logs each event once. It
never imports torch.

On start it checks the state directory (`statedir`) and takes its single-instance lock, then
reads the node's journal: processes of an attempt that a previous supervisor left running (it
was `kill -9`ed, the node's systemd restarted it) are found by their attempt's mark and stopped
before anything new is launched, so two attempts never run at once. No pid is signalled only
because a journal or a heartbeat names it (`ftsup.procs`).

Once the loop runs, an I/O error of the store, journal or control file is an outage to ride out
(`ftsup.supervisor.outages`), a failed launch a failed attempt, any other exception a bug (exit 1).
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from ftsup import procs, protocol
from ftsup.store import choice
from ftsup.store.errors import CheckpointError
from ftsup.supervisor import health, launcher, logs, policy, statedir, systemd
from ftsup.supervisor.ckptstore import StoreScanner
from ftsup.supervisor.config import JobConfig, settings_from
from ftsup.supervisor.errors import ConfigError, error_line
from ftsup.supervisor.eviction.notices import Blind, Notice, Seeing, from_signal
from ftsup.supervisor.eviction.providers import WatchError
from ftsup.supervisor.eviction.requeue import requeue
from ftsup.supervisor.eviction.runner import WatcherThreads
from ftsup.supervisor.eviction.setup import build_watchers
from ftsup.supervisor.heartbeat import Admission, HeartbeatReceiver
from ftsup.supervisor.journal import Journal, JournalError, JournalRecord
from ftsup.supervisor.metrics import Metrics, MetricsServer
from ftsup.supervisor.outages import Outages
from ftsup.supervisor.wakeup import Wakeup

_T = TypeVar("_T")
_STORE_ERRORS = (OSError, CheckpointError)  # what reading the store raises while it is unreadable or mid-change
TICK_S = 0.1
CHOICE_TIMEOUT_S = 60.0  # the resume choice waits this long for the store, then leaves it to the ranks
_GONE = frozenset({-1})  # torchrun's ranks were seen and are gone

log = structlog.get_logger("ftsup.supervisor")


class Daemon:
    def __init__(self, cfg: JobConfig, *, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.node_dir = Path(cfg.job.state_dir)
        self.journal = Journal(self.node_dir / "journal.json")
        self.log_dir = Path(cfg.logging.dir) if cfg.logging.dir else self.node_dir / "logs"
        self.attempt: launcher.RunningAttempt | None = None
        self.pending: list[policy.Event] = []
        self.world_size: int | None = None
        self.resume_step: int | None = None
        self.last_failure: str | None = None
        self._notices: dict[str, Notice] = {}  # by source, to acknowledge once saved
        self._watchers: WatcherThreads | None = None
        self._runtime_dir: Path | None = None
        self._runtime: statedir.RuntimeDir | None = None
        self._ranks_seen: frozenset[int] = frozenset()
        self._rank_phase: dict[int, protocol.Phase] = {}  # pid -> last heartbeat phase, this attempt
        self.last_attempt = 0
        self.metrics = Metrics(cfg.job.run_id, cfg.launch.node_id, started_unix=time.time())
        self._metrics_server: MetricsServer | None = None
        self.crash: str | None = None  # the line for stderr when the loop ended on a bug
        self.outages = Outages(self._emit, self.metrics.storage_error, clock)
        self._store = StoreScanner(cfg.checkpoint.dir, deep=cfg.checkpoint.verify_deep)  # all reads of the store
        self._store_seen = (0, 0)  # (scans, errors) of the view last handed to the metrics

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        """Supervise the job until it ends; returns the exit status. A state directory that is not
        safe, or one that another supervisor holds, is refused before anything starts."""
        self.node_dir = statedir.ensure_dir(self.node_dir, "job.state_dir")
        lock = statedir.InstanceLock(self.node_dir)  # before the journal is read: one supervisor per state dir
        try:
            statedir.ensure_dir(self.log_dir, "logging.dir" if self.cfg.logging.dir else "job.state_dir")
            self._runtime_dir = self._make_runtime_dir()
            return self._run(self._runtime_dir)
        finally:
            if self._runtime is not None:
                self._runtime.remove()
            lock.close()

    def _run(self, runtime_dir: Path) -> int:
        logfile = logs.configure(self.cfg.logging.level, self.cfg.logging.format, self.log_dir / "supervisor.jsonl")
        try:  # nothing has started yet: a failure here leaves nothing behind
            self._serve_metrics()
            receiver = HeartbeatReceiver(runtime_dir, counter=self.metrics.heartbeats_dropped)
        except BaseException:
            if self._metrics_server is not None:
                self._metrics_server.close()
            if logfile is not None:
                logfile.close()
            raise
        admission = Admission()  # only processes of the running attempt may beat
        handled = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} | {
            getattr(signal, n) for n in self.cfg.eviction.signals
        }
        # Beats are read once a tick, not on arrival: a flood costs one bounded drain a tick, not a busy loop.
        wakeup = Wakeup(handled, [])
        self._watchers = WatcherThreads(build_watchers(self.cfg.eviction), self.cfg.eviction.poll_interval_s,
                                        wake=wakeup.writer).start()  # fmt: skip
        self._store.start()
        code = policy.EXIT_INTERNAL
        try:
            self._emit("info", "supervisor_started", run_id=self.cfg.job.run_id, node_id=self.cfg.launch.node_id,
                       pid=os.getpid(), config=self.cfg.source,
                       metrics=self._metrics_server.address if self._metrics_server else None)  # fmt: skip
            adopted = self._adopt_journal()
            systemd.notify("READY=1", f"STATUS=supervising {self.cfg.job.run_id}")
            nproc_max = self._nproc_max()
            # Attempt numbers go on from the journal: log files and FTSUP_ATTEMPT stay unique.
            machine = policy.Machine(settings_from(self.cfg, nproc_max), policy.State(attempt_no=adopted))
            self.pending.append(policy.Start())
            while True:
                while self.pending:
                    now = self.clock()
                    machine, actions = machine.feed(self.pending.pop(0), now)
                    self.metrics.state(machine.state, machine.settings, now, time.time())
                    result = self._execute(actions)
                    if result is not None:
                        code = result
                        return code
                self.outages.run_due()
                self._refresh_checkpoint_metrics()
                wakeup.wait(TICK_S)
                self.pending.extend(self._signal_event(name) for name in wakeup.signals())
                for report in self._watchers.drain():
                    self._watch_report(report)
                new_pids = False
                for beat in receiver.drain(admit=lambda pid: admission.admits(self.attempt, pid)):
                    if self.attempt is not None and beat.attempt == self.attempt.number:
                        new_pids |= beat.pid not in self.attempt.known_pids
                        self.attempt.known_pids.add(beat.pid)
                        self._rank_phase[beat.pid] = beat.phase
                        self.metrics.heartbeat(beat.rank, dict(beat.figures))
                    self.pending.append(policy.Heartbeat(beat.attempt, beat.local_rank, beat.step, beat.phase,
                                                         beat.rank, beat.figures, sent=beat.sent_mono))  # fmt: skip
                if (dropped := receiver.drops_to_log(self.clock(), every_s=10.0)) is not None:
                    self._emit("warning", "heartbeats_dropped", **dropped)
                if new_pids:  # so that a restarted supervisor can find every rank of this attempt
                    self._write_journal("running")
                if self.attempt is not None:
                    rc = self.attempt.poll()
                    if rc is not None:
                        self._reap_after_exit(rc)
                    else:
                        self._watch_ranks()
                        self._watch_worker_group()
                self.pending.append(policy.Tick())
        except Exception as e:
            # What is expected (outages, failed launches) is handled where it happens; this is a bug. Exit status
            # 1 is restarted by systemd, and the new supervisor adopts the journal.
            code = policy.EXIT_INTERNAL
            what = "I/O error" if isinstance(e, OSError) else "internal error"  # an I/O error not ridden out
            self.crash = f"{what}: {error_line(e)} (traceback in {self.log_dir / 'supervisor.jsonl'})"
            self._emit(
                "error", "supervisor_crashed", reason=f"{what}: {error_line(e)}", traceback=traceback.format_exc()
            )
            return code
        finally:
            if self.attempt is not None:  # an exception must not leave an attempt running
                self.attempt.stop(self.cfg.restart.stop_grace_s)
            self._watchers.close()
            self._store.close()
            systemd.notify("STOPPING=1")
            wakeup.close()
            receiver.close()
            if self._metrics_server is not None:
                self._metrics_server.close()
            self._emit("info", "supervisor_exited", code=code)
            if logfile is not None:
                logfile.close()

    def _signal_event(self, name: str) -> policy.Event:
        if name in self.cfg.eviction.signals:
            return self._notice_event(from_signal(name, time.time(), self.cfg.eviction.default_deadline_s))
        return policy.OperatorStop(name)

    def _notice_event(self, notice: Notice) -> policy.EvictionNoticed:
        self._notices[notice.source] = notice
        deadline = self.clock() + (notice.deadline_unix - time.time())  # wall clock -> the loop's clock
        latest = self._store.view().latest  # as last scanned: an estimate, never a wait on the store
        state_bytes = latest.tensor_bytes if latest else None
        systemd.extend_timeout(max(1.0, notice.deadline_unix - time.time()) + self.cfg.restart.stop_grace_s)
        return policy.EvictionNoticed(notice.source, deadline, notice.detail, notice.advisory, state_bytes)

    def _watch_report(self, report: Notice | Blind | Seeing) -> None:
        if isinstance(report, Notice):
            self.pending.append(self._notice_event(report))
        elif isinstance(report, Blind):
            # A blind watcher must not look healthy: say so; the eviction state is unknown.
            self._emit("warning", "watcher_went_blind", source=report.source, reason=report.reason)
        else:
            self._emit("info", "watcher_recovered", source=report.source)

    # ------------------------------------------------------------------ actions

    def _execute(self, actions: list[policy.Action]) -> int | None:
        for action in actions:
            if isinstance(action, policy.Log):
                self._emit(action.level, action.event, **action.as_dict())
                if action.level == "error" and "reason" in action.as_dict():
                    self.last_failure = str(action.as_dict()["reason"])
            elif isinstance(action, policy.PrepareLaunch):
                self._prepare_or_retry(action.attempt)
            elif isinstance(action, policy.Launch):
                self._launch_or_fail(action)
            elif isinstance(action, policy.StopWorkers):
                self._stop(action)
            elif isinstance(action, policy.RequestSave):
                self._request_save_or_retry(action)
            elif isinstance(action, policy.AckEviction):
                self._ack(action.source)
            elif isinstance(action, policy.Exit):
                self._write_journal(_exit_status(action.code))
                if action.code == policy.EXIT_EVICTED:
                    requeue(self.cfg.eviction.requeue_command, os.environ, self._emit)
                return action.code
        return None

    def _emit(self, level: str, event: str, **fields: Any) -> None:
        """Log an event and count it: every log event goes through here, so metrics and logs agree."""
        try:
            getattr(log, level)(event, **fields)
        except OSError:  # the log file (stderr got the line first); logging that would fail the same way
            self.metrics.storage_error("log_file")
        self.metrics.event(event, fields)

    def _read_store(self, read: Callable[[], _T], retry: tuple[str, Callable[[], None]] | None = None) -> _T | None:
        """`read()` of the checkpoint store, or None while it cannot be read (an outage: logged, counted)."""
        return self.outages.guard("checkpoint_dir", self.cfg.checkpoint.dir, read, errors=_STORE_ERRORS, retry=retry)

    def _serve_metrics(self) -> None:
        listen = self.cfg.metrics.listen
        if listen is None:
            return
        try:
            self._metrics_server = MetricsServer(self.metrics, listen)
        except OSError as e:
            raise ConfigError(
                f"metrics.listen={listen!r}: cannot serve /metrics there ({e.strerror or e}); choose a free port "
                "(0 picks one) or set it to null"
            ) from None

    def _refresh_checkpoint_metrics(self) -> None:
        """Hand the scanner's latest view to the metrics (no I/O here); a failed scan is an outage."""
        view = self._store.view()
        scans, errors = self._store_seen
        if (view.scans, view.errors) == (scans, errors):
            return
        self._store_seen = (view.scans, view.errors)
        for _ in range(view.errors - errors):
            self.outages.failed(
                "checkpoint_dir", self.cfg.checkpoint.dir, view.last_exception or OSError(view.last_error)
            )
        if view.scans - scans > view.errors - errors:  # a scan since then went through
            self.outages.ok("checkpoint_dir")
        self.metrics.checkpoint(view.latest, view.committed)

    def _control_path(self) -> Path:
        assert self._runtime_dir is not None
        return self._runtime_dir / "control.json"

    def _request_save_or_retry(self, action: policy.RequestSave) -> None:
        again = ("control_file", lambda: self._request_save_or_retry(action))  # a newer request replaces it
        self.outages.guard("control_file", self._control_path(), lambda: self._request_save(action), retry=again)

    def _request_save(self, action: policy.RequestSave) -> None:
        deadline_unix = None if action.deadline is None else time.time() + (action.deadline - self.clock())
        body = protocol.encode_control(protocol.Request(action.seq, action.stop, action.reason, deadline_unix))
        # Ranks see the old request or the new one, never half of one; never written through a link.
        statedir.write_atomic(self._control_path(), body, durable=False)

    def _ack(self, source: str) -> None:
        notice = self._notices.get(source)
        if notice is None or self._watchers is None:
            return
        try:
            self._watchers.ack(notice)
        except WatchError as e:
            self._emit("warning", "watcher_went_blind", source=source, reason=f"acknowledgement failed: {e}")

    def _prepare_or_retry(self, attempt: int) -> None:
        # While the store cannot be read, wait: the resume point must come from the store, not from its absence.
        ready = self._read_store(lambda: self._prepare(attempt), ("prepare", lambda: self._prepare_or_retry(attempt)))
        if ready is not None:
            self.pending.append(ready)

    def _prepare(self, attempt: int) -> policy.LaunchReady:
        h = health.probe(self.cfg.launch.health_command, self.cfg.launch.nproc_per_node)
        if h.count is None:
            # A blind probe must not look healthy: keep the last known world size.
            self._emit("warning", "health_probe_failed", attempt=attempt, reason=h.detail, source=h.source)
            slots = self.world_size or self._nproc_max()
        else:
            slots = h.count
            self._emit("info", "health_probed", attempt=attempt, source=h.source, slots=list(h.slots or ()))
        step, meta = self._choose_checkpoint(attempt)
        return policy.LaunchReady(slots, step, self._batch_divisor(meta))

    def _choose_checkpoint(self, attempt: int) -> tuple[int | None, dict[str, Any]]:
        resume = self._store.choose(CHOICE_TIMEOUT_S)  # made on the scanner's thread
        for p in resume.picked.passed:
            if p.action == choice.QUARANTINED:
                self._emit("error", "checkpoint_quarantined", attempt=attempt, step=p.step, reason=p.reason,
                           path=p.moved_to)  # fmt: skip
            else:
                self._emit("warning", "checkpoint_skipped", attempt=attempt, step=p.step, reason=p.reason, path=p.path)
        info = resume.picked.info
        if info is None:
            self._emit("info" if resume.quiet else "warning", "checkpoint_chosen", attempt=attempt, step=None,
                       reason=resume.why_no_checkpoint)  # fmt: skip
            return None, {}
        self._emit("info", "checkpoint_chosen", attempt=attempt, step=info.step, kind=info.kind)
        return info.step, resume.metadata

    def _batch_divisor(self, meta: dict[str, Any]) -> int | None:
        g = self.cfg.launch.global_batch or meta.get("global_batch")
        b = self.cfg.launch.micro_batch or meta.get("micro_batch")
        if isinstance(g, int) and g > 0:
            return g // b if isinstance(b, int) and b > 0 and g % b == 0 else g
        return None

    def _launch_or_fail(self, action: policy.Launch) -> None:
        try:
            self._launch(action)
        except OSError as e:  # nothing started (fork, exec, the log file): a failed attempt, restarted as usual
            self._emit("error", "launch_failed", attempt=action.attempt, reason=error_line(e))
            self.pending.append(policy.WorkersExited(action.attempt, 127))

    def _launch(self, action: policy.Launch) -> None:
        assert self._runtime_dir is not None
        env = launcher.rank_env(self.cfg, self._runtime_dir, action.resume_step, os.environ)
        self.world_size, self.resume_step = action.nproc, action.resume_step
        self._ranks_seen = frozenset()
        self._rank_phase = {}
        try:  # a new attempt starts with no request pending
            self._control_path().unlink()
        except FileNotFoundError:
            pass
        log_path = self.log_dir / f"attempt-{action.attempt:04d}.log"
        # SIGTERM and SIGINT stay default: they are how a tree is stopped.
        ignore = tuple(getattr(signal, n) for n in self.cfg.eviction.signals if n not in ("SIGTERM", "SIGINT"))
        mark = procs.Mark(self.cfg.job.run_id, self.cfg.launch.node_id, action.attempt)
        argv = launcher.torchrun_argv(launcher.spec_from(self.cfg, action.nproc))
        self.attempt = launcher.start(action.attempt, argv, env=env, cwd=self.cfg.job.workdir,
                                      log_path=log_path, mark=mark, ignore_signals=ignore)  # fmt: skip
        self.last_attempt = action.attempt
        self._write_journal("running")
        self.pending.append(policy.WorkersStarted(action.attempt, (self.attempt.pid,)))

    def _stop(self, action: policy.StopWorkers) -> None:
        att = self.attempt
        if att is None or att.number != action.attempt:
            return
        t0 = self.clock()
        grace = (
            self.cfg.restart.stop_grace_s
            if action.grace_s is None
            else min(action.grace_s, self.cfg.restart.stop_grace_s)
        )
        survivors = att.stop(grace, clock=self.clock)
        if survivors:
            self._emit("error", "orphans_found", attempt=att.number, pids=survivors)
        self._emit("info", "workers_stopped", attempt=att.number, reason=action.reason,
                 duration_s=round(self.clock() - t0, 3))  # fmt: skip
        rc = att.poll()
        self.attempt = None
        self._write_journal("backoff")
        self.pending.append(policy.WorkersExited(att.number, rc if rc is not None else -signal.SIGKILL))

    def _watch_ranks(self) -> None:
        """A rank that died while training (single node): fail now, not when torchrun exits."""
        att = self.attempt
        if att is None or self.cfg.launch.max_nodes > 1:
            return  # on several nodes torchrun replaces ranks itself when the membership changes
        for pid, phase in list(self._rank_phase.items()):
            if phase != protocol.Phase.DONE and not launcher.pid_alive(pid):
                del self._rank_phase[pid]
                self.pending.append(policy.RankExited(att.number, pid, None))

    def _watch_worker_group(self) -> None:
        """Notice torchrun replacing its ranks (a rendezvous membership change)."""
        att = self.attempt
        assert att is not None
        pids = att.rank_pids()
        prev = self._ranks_seen
        if prev and pids != prev and not pids & prev:
            # Its ranks are gone (or replaced) while torchrun lives on: ranks finishing, or
            # torchrun re-forming the worker group (a rendezvous and a fresh start of every rank).
            # Either way their old heartbeats mean nothing now; only new ranks are a restart.
            if pids:
                self.pending.append(policy.WorkersRestarted(att.number, new_ranks=True))
            elif prev != _GONE:
                self.pending.append(policy.WorkersRestarted(att.number, new_ranks=False))
        self._ranks_seen = pids if pids else (_GONE if prev else frozenset())

    def _reap_after_exit(self, rc: int) -> None:
        """torchrun exited by itself: make sure none of its ranks outlive it."""
        att = self.attempt
        assert att is not None
        survivors = att.stop(self.cfg.restart.stop_grace_s, clock=self.clock) if att.tree() else []
        if survivors:
            self._emit("error", "orphans_found", attempt=att.number, pids=survivors)
        self.attempt = None
        self.pending.append(policy.WorkersExited(att.number, rc))

    # ------------------------------------------------------------------ journal, slots, runtime dir

    def _write_journal(self, status: str) -> None:
        att = self.attempt
        # Only processes of the attempt (its tree, its mark): a pid claimed in a heartbeat is not journaled as such.
        pids = tuple(sorted({p.pid for p in att.tree()})) if att is not None else ()
        record = JournalRecord(
            run_id=self.cfg.job.run_id, node_id=self.cfg.launch.node_id, supervisor_pid=os.getpid(),
            attempt=att.number if att else self.last_attempt, world_size=self.world_size,
            resume_step=self.resume_step, pids=pids,
            attempt_started_unix=att.started_at if att else None, last_failure=self.last_failure, status=status,
            updated_unix=time.time(), extra=self._journal_extra(),
        )  # fmt: skip
        again = ("journal", lambda: self._write_journal(status))  # a later write supersedes it
        self.outages.guard("journal", self.journal.path, lambda: self.journal.write(record), retry=again)

    def _journal_extra(self) -> dict[str, Any]:
        latest = self._store.view().latest  # as last scanned
        extra: dict[str, Any] = {"latest_checkpoint": latest.step if latest else None}
        if self._metrics_server is not None:
            extra["metrics"] = self._metrics_server.address
        if self._notices:
            extra["eviction"] = [{"source": n.source, "deadline_unix": n.deadline_unix, "detail": n.detail}
                                 for n in self._notices.values()]  # fmt: skip
        return extra

    def _adopt_journal(self) -> int:
        """Stop what a previous supervisor of this job and node left running; return its last attempt number.

        The journal is hostile input (someone may have planted it): only processes that carry the
        journaled attempt's mark of this job and node, are ours and were created since that attempt
        started are stopped. The journal's own pid list is never signalled."""
        try:
            rec = self.journal.read(owner=os.geteuid())
        except JournalError as e:
            self._emit("warning", "journal_ignored", reason=str(e))
            return 0
        if rec is None:
            return 0
        self._emit("info", "journal_adopted", attempt=rec.attempt, status=rec.status, world_size=rec.world_size,
                 step=rec.resume_step, supervisor_pid=rec.supervisor_pid)  # fmt: skip
        mine = (rec.run_id, rec.node_id) == (self.cfg.job.run_id, self.cfg.launch.node_id)
        if mine and rec.attempt_started_unix is not None:
            mark = procs.Mark(rec.run_id, rec.node_id, rec.attempt)
            since = rec.attempt_started_unix
            found = procs.find(mark, since=since, until=time.time())
            if found:
                procs.stop(lambda: procs.find(mark, since=since), self.cfg.restart.stop_grace_s)
                self._emit("warning", "leftovers_stopped", attempt=rec.attempt, pids=sorted(p.pid for p in found))
        return rec.attempt

    def _nproc_max(self) -> int:
        n = self.cfg.launch.nproc_per_node
        if n != "auto":
            return int(n)
        h = health.probe(None, "auto")
        return h.count or 1

    def _make_runtime_dir(self) -> Path:
        self._runtime = statedir.RuntimeDir.make(self.node_dir, os.environ)  # systemd's RuntimeDirectory, if any
        return self._runtime.path


def _exit_status(code: int) -> str:
    return {
        policy.EXIT_OK: "succeeded", policy.EXIT_EVICTED: "evicted", policy.EXIT_STOPPED: "stopped",
    }.get(code, "failed")  # fmt: skip
