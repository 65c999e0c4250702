"""The running attempt as the daemon's loop sees it: launched, watched, asked to save, stopped and reaped.

When to launch or stop, and what a beat means, are the policy's decisions (docs/design/run-loop.md, The running
attempt).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from ftsup import procs, protocol
from ftsup.supervisor import statedir
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.errors import error_line
from ftsup.supervisor.policy import hangs
from ftsup.supervisor.policy import machine as policy
from ftsup.supervisor.policy.events import RanksStarted
from ftsup.supervisor.run import echo, flightrec, forensics, launcher, ranklogs, warmagent
from ftsup.supervisor.run.heartbeat import Admission, Beat
from ftsup.supervisor.run.outages import Outages
from ftsup.supervisor.state import ranks as rankstatus

_GONE = frozenset({-1})  # torchrun's ranks were seen and are gone
DEAD_RANK_GRACE_S = 2.0  # room for torchrun to report a rank's death, which it does once it has stopped the others
PARK_AFTER_S = 60.0  # with no training step heard (heartbeats off), a spare is parked this long after a launch


class Workers:
    def __init__(
        self,
        cfg: JobConfig,
        log_dir: Path,
        *,
        clock: Callable[[], float],
        emit: Callable[..., None],
        post: Callable[[policy.Event], None],
        outages: Outages,
        journal: Callable[[str], None],
        figures: Callable[[int, Mapping[str, float]], None],
    ) -> None:
        """`emit(level, event, **fields)` logs an event, `post(event)` queues one for the policy, `journal(status)`
        writes the journal, `figures(rank, figures)` hands a rank's reported figures to the metrics."""
        self.cfg = cfg
        self.log_dir = log_dir
        self._clock = clock
        self._emit = emit
        self._post = post
        self._outages = outages
        self._journal = journal
        self._figures = figures
        self.attempt: launcher.RunningAttempt | None = None
        self._spare: warmagent.Spare | None = None  # parked for the next attempt (`launch.warm_agent`)
        self._echo: echo.Echo | None = None  # the attempt's output on stdout (`logging.echo`)
        self._launched: tuple[float, str, dict[str, str]] | None = None  # the last launch: when, interpreter, env
        self._admission = Admission()  # only processes of the running attempt may beat
        self._runtime_dir: Path | None = None
        self._ranks_seen: frozenset[int] = frozenset()
        self._rank_phase: dict[int, protocol.Phase] = {}  # pid -> last heartbeat phase, this attempt
        self._rank_of: dict[int, tuple[int, int]] = {}  # pid -> (rank, local rank), this attempt
        self._dead_at: dict[int, float] = {}  # pid -> when it was first seen dead
        self._start_ticks: dict[int, int] = {}  # pid -> its start time as first read, this attempt
        self._table = rankstatus.RankTable(
            Path(cfg.job.state_dir) / rankstatus.FILE_NAME,
            write=lambda path, op: outages.guard("rank_status", path, op),
        )

    @contextlib.contextmanager
    def running(self, runtime_dir: Path) -> Iterator[Workers]:
        self._runtime_dir = runtime_dir
        try:
            yield self
        finally:
            if self.attempt is not None:  # an exception must not leave an attempt running
                self.attempt.stop(self.cfg.restart.stop_grace_s)
            self._end_echo()
            self._drop_spare()

    # ------------------------------------------------------------------ what the loop reads each tick

    def admits(self, pid: int) -> bool:
        return self._admission.admits(self.attempt, pid)

    def vet(self, beat: Beat) -> str | None:
        """Why a beat of an admitted sender does not count (a `DROP_REASONS` entry), None when it does."""
        return self._admission.vet(self.attempt, beat, self._clock())

    def beats(self, beats: Iterable[Beat]) -> list[policy.Event]:
        """The policy's events of `beats`. A new rank of this attempt is journaled, so that a restarted supervisor
        can find every rank of it."""
        events: list[policy.Event] = []
        new_pids = False
        for beat in beats:
            att = self.attempt
            if att is not None and beat.attempt == att.number:
                new_pids |= beat.pid not in att.known_pids
                att.known_pids.add(beat.pid)
                self._rank_phase[beat.pid] = beat.phase
                self._rank_of[beat.pid] = (beat.rank, beat.local_rank)
                self._table.heard(beat)
                self._figures(beat.rank, dict(beat.figures))
            events.append(
                policy.Heartbeat(
                    beat.attempt, beat.local_rank, beat.step, beat.phase, beat.rank, beat.figures, sent=beat.sent_mono
                )
            )
        if new_pids:
            self._journal("running")
        self._table.flush(self._clock())
        return events

    def states(self) -> tuple[tuple[int, str], ...]:
        """The process state of each rank of this attempt that beat, by local rank (`/proc/PID/stat`'s letter, or
        `hangs.GONE`): what tells the policy a stopped rank from one that waits for it. Only pids the heartbeat
        channel admitted as the attempt's ranks are read; one that names a later process is gone."""
        found: dict[int, str] = {}
        for pid, phase in self._rank_phase.items():
            local = self._rank_of.get(pid, (None, None))[1]
            if local is None or phase == protocol.Phase.DONE:
                continue
            got = procs.run_state(pid)
            if got is not None and self._start_ticks.setdefault(pid, got[1]) != got[1]:
                got = None  # the pid was given to another process
            state = hangs.GONE if got is None else got[0]
            if found.get(local) in (None, hangs.GONE):  # a rank torchrun started again: its live process counts
                found[local] = state
        return tuple(sorted(found.items()))

    def targets(self) -> list[forensics.Target]:
        """The ranks of the running attempt, for a capture of their evidence: those the heartbeat channel admitted
        (with their last beat), and torchrun's other children that carry the attempt's mark and a rank."""
        att = self.attempt
        if att is None:
            return []
        heard = self._table.heard_of()
        found: dict[int, forensics.Target] = {}
        for pid, (rank, local) in self._rank_of.items():
            b = heard.get(local)
            last = (b.step, b.phase, b.beat_unix) if b is not None and b.pid == pid else (None, None, None)
            if local not in found or last[0] is not None:
                found[local] = forensics.Target(rank, local, pid, self._start_ticks.get(pid), *last)
        for pid in sorted(att.rank_pids() - {t.pid for t in found.values()}):
            env = procs.environ_of(pid, att.mark, since=att.started_at) or {}
            said, local_said, state = env.get("RANK", ""), env.get("LOCAL_RANK", ""), procs.run_state(pid)
            if said.isdigit() and local_said.isdigit() and int(local_said) not in found and state is not None:
                found[int(local_said)] = forensics.Target(int(said), int(local_said), pid, state[1])
        return [found[k] for k in sorted(found)]

    def watch(self) -> list[policy.Event]:
        """What became of the running attempt since the last tick."""
        att = self.attempt
        if att is None:
            return []
        rc = att.poll()
        if rc is not None:
            return [self._reap(att, rc)]
        self._park_spare(att)
        return [*self._dead_ranks(att), *self._worker_group(att)]

    def _reap(self, att: launcher.RunningAttempt, rc: int) -> policy.Event:
        """torchrun exited by itself: make sure none of its ranks outlive it, and read what it reported."""
        survivors = att.stop(self.cfg.restart.stop_grace_s, clock=self._clock) if att.tree() else []
        if survivors:
            self._emit("error", "orphans_found", attempt=att.number, pids=survivors)
        self.attempt = None
        self._end_echo()  # its last lines before the supervisor's word on how it ended
        if rc == 0:
            return policy.WorkersExited(att.number, rc)
        failures, output = ranklogs.gather(att.log_path, ranklogs.ranks_dir(att.log_path))
        return policy.WorkersExited(att.number, rc, failures, output)

    def _dead_ranks(self, att: launcher.RunningAttempt) -> list[policy.Event]:
        """A rank that died while training (single node): fail now, not when torchrun exits (after a grace in
        which torchrun's own report, with the exit status, comes first)."""
        if self.cfg.launch.max_nodes > 1:
            return []  # on several nodes torchrun replaces ranks itself when the membership changes
        events: list[policy.Event] = []
        now = self._clock()
        for pid, phase in list(self._rank_phase.items()):
            if phase == protocol.Phase.DONE or launcher.pid_alive(pid):
                continue
            if now - self._dead_at.setdefault(pid, now) < DEAD_RANK_GRACE_S:
                continue
            del self._rank_phase[pid]
            rank, local = self._rank_of.get(pid, (None, None))
            output = () if local is None else tuple(ranklogs.rank_output(ranklogs.ranks_dir(att.log_path), local))
            failure = policy.RankFailure(rank, local, pid, output=output)
            events.append(policy.RankExited(att.number, pid, None, failure=failure))
        return events

    def _worker_group(self, att: launcher.RunningAttempt) -> list[policy.Event]:
        """Notice torchrun replacing its ranks (a rendezvous membership change)."""
        pids = att.rank_pids()
        prev = self._ranks_seen
        events: list[policy.Event] = []
        if pids and not prev:  # its first ranks: the rendezvous is over (a hot spare's wait among them)
            events.append(RanksStarted(att.number))
        if prev and pids != prev and not pids & prev:
            # Its ranks are gone (or replaced) while torchrun lives on: ranks finishing, or
            # torchrun re-forming the worker group (a rendezvous and a fresh start of every rank).
            # Either way their old heartbeats mean nothing now; only new ranks are a restart.
            if pids:
                events.append(policy.WorkersRestarted(att.number, new_ranks=True))
            elif prev != _GONE:
                events.append(policy.WorkersRestarted(att.number, new_ranks=False))
        self._ranks_seen = pids if pids else (_GONE if prev else frozenset())
        return events

    # ------------------------------------------------------------------ the policy's actions

    def launch_or_fail(self, action: policy.Launch) -> None:
        try:
            self._launch(action)
        except OSError as e:  # nothing started (fork, exec, the log file): a failed attempt, restarted as usual
            self._emit("error", "launch_failed", attempt=action.attempt, reason=error_line(e))
            self._post(policy.WorkersExited(action.attempt, 127))

    def _launch(self, action: policy.Launch) -> None:
        env = launcher.rank_env(
            self.cfg, self._runtime(), action.resume_step, os.environ, action.skips, action.resume_bound
        )
        if self.cfg.forensics.enabled and self.cfg.forensics.nccl_flight_recorder:  # a hang's evidence: NCCL's record
            env.update(flightrec.rank_env(Path(self.cfg.job.state_dir), action.attempt, env))
        self._ranks_seen = frozenset()
        self._rank_phase, self._rank_of, self._dead_at, self._start_ticks = {}, {}, {}, {}
        self._admission.launched(action.attempt, action.resume_step, self._clock())
        self._table.started(action.attempt)
        with contextlib.suppress(FileNotFoundError):  # a new attempt starts with no request pending
            self._control_path().unlink()
        log_path = self.log_dir / f"attempt-{action.attempt:04d}.log"
        begins = echo.size_of(log_path)  # appended to: the attempt's output begins at its end now
        mark = procs.Mark(self.cfg.job.run_id, self.cfg.launch.node_id, action.attempt)
        argv = launcher.torchrun_argv(launcher.spec_from(self.cfg, action.nproc, ranklogs.ranks_dir(log_path)))
        launch = launcher.Launch(action.attempt, argv, env, self.cfg.job.workdir, log_path, mark)
        spare, self._spare = self._spare, None
        warm = spare.go(launch) if spare is not None else None
        self.attempt = warm or self._start_cold(launch)
        self._end_echo()
        self._echo = echo.Echo(log_path, begins) if self.cfg.logging.echo else None
        # The spare's environment at exec (what /proc shows of it) has no attempt's resume step or skips in it.
        self._launched = (self._clock(), argv[0], launcher.rank_env(self.cfg, self._runtime(), None, os.environ))
        self._journal("running")
        if warm is not None:
            self._emit("info", "spare_agent_used", attempt=action.attempt, pid=warm.pid)
        self._post(policy.WorkersStarted(action.attempt, (self.attempt.pid,), log=str(log_path)))

    def _start_cold(self, launch: launcher.Launch) -> launcher.RunningAttempt:
        """An attempt with no spare parked for it. With `launch.warm_agent` it starts in a spare too, parked and
        handed the attempt at once (the imports are waited for as a plain torchrun's would be; its exit is quick);
        plain torchrun (`launcher.start`) where that cannot be done."""
        ignored = self._ignored()
        if self.cfg.launch.warm_agent:
            try:
                spare = warmagent.park(
                    launch.number,
                    launch.argv[0],
                    env=launch.env,
                    cwd=launch.cwd,
                    mark=launch.mark,
                    ignore_signals=ignored,
                    log_path=launch.log_path,
                )
            except OSError as e:
                self._emit("warning", "spare_agent_failed", attempt=launch.number, reason=error_line(e))
            else:
                att = spare.go(launch)
                if att is not None:
                    return att
        return launcher.start(launch, ignore_signals=ignored)

    def _park_spare(self, att: launcher.RunningAttempt) -> None:
        """With `launch.warm_agent`, park a spare for the next attempt once this one trains (its ranks' imports
        done: the spare's do not slow them), or `PARK_AFTER_S` after its launch. One that cannot be started is
        logged; the next attempt then starts cold."""
        if not self.cfg.launch.warm_agent or self._launched is None or self._spare is not None:
            return
        launched_at, python, env = self._launched
        if protocol.Phase.TRAIN not in self._rank_phase.values() and self._clock() - launched_at < PARK_AFTER_S:
            return
        self._launched = None  # one try per attempt
        mark = procs.Mark(self.cfg.job.run_id, self.cfg.launch.node_id, att.number + 1)
        try:
            self._spare = warmagent.park(
                att.number + 1, python, env=env, cwd=self.cfg.job.workdir, mark=mark, ignore_signals=self._ignored()
            )
        except OSError as e:
            self._emit("warning", "spare_agent_failed", attempt=att.number + 1, reason=error_line(e))
            return
        self._emit("info", "spare_agent_parked", attempt=att.number + 1, pid=self._spare.proc.pid)

    def _ignored(self) -> tuple[int, ...]:
        """The notice signals the job's processes ignore (the supervisor's); SIGTERM and SIGINT stay default: they
        are how a tree is stopped."""
        return tuple(getattr(signal, n) for n in self.cfg.eviction.signals if n not in ("SIGTERM", "SIGINT"))

    def _end_echo(self) -> None:
        echoing, self._echo = self._echo, None
        if echoing is not None:
            echoing.close()

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.discard()

    def stop(self, action: policy.StopWorkers) -> None:
        att = self.attempt
        if att is None or att.number != action.attempt:
            return
        t0 = self._clock()
        grace = self.cfg.restart.stop_grace_s
        one_node = self.cfg.launch.max_nodes == 1
        if action.grace_s is not None:
            grace = min(action.grace_s, grace)
        survivors = att.stop(grace, clock=self._clock, one_node=one_node)
        if survivors:
            self._emit("error", "orphans_found", attempt=att.number, pids=survivors)
        took = round(self._clock() - t0, 3)
        self._end_echo()
        self._emit("info", "workers_stopped", attempt=att.number, reason=action.reason, duration_s=took)
        rc = att.poll()
        self.attempt = None
        self._journal("backoff")
        self._post(policy.WorkersExited(att.number, rc if rc is not None else -signal.SIGKILL))

    def request_save_or_retry(self, action: policy.RequestSave) -> None:
        again = ("control_file", lambda: self.request_save_or_retry(action))  # a newer request replaces it
        self._outages.guard("control_file", self._control_path(), lambda: self._request_save(action), retry=again)

    def _request_save(self, action: policy.RequestSave) -> None:
        deadline_unix = None if action.deadline is None else time.time() + (action.deadline - self._clock())
        body = protocol.encode_control(protocol.Request(action.seq, action.stop, action.reason, deadline_unix))
        # Ranks see the old request or the new one, never half of one; never written through a link.
        statedir.write_atomic(self._control_path(), body, durable=False)

    def _runtime(self) -> Path:
        assert self._runtime_dir is not None, "Workers.running() was not entered"
        return self._runtime_dir

    def _control_path(self) -> Path:
        return self._runtime() / "control.json"
