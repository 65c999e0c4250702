"""The supervisor's decisions: a pure state machine `step(settings, state, event, now) -> (state, actions)`.

No I/O, no clock: the daemon feeds events with the time they happened and carries out the actions. The state
machine is written down whole in docs/design/policy.md, "The state machine".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# The policy's vocabulary; callers use it as policy.X (policy.Heartbeat, policy.Launch, ...).
from ftsup.protocol import LONG_PHASES, QUIET_PHASES, Phase
from ftsup.supervisor.config.job import HeartbeatMode
from ftsup.supervisor.policy import anomaly as policy_anomaly
from ftsup.supervisor.policy import evidence, failures, hangs, progress, saves, standby
from ftsup.supervisor.policy.events import (
    AckEviction,
    Action,
    Event,
    EvictionNoticed,
    Exit,
    Heartbeat,
    Launch,
    LaunchReady,
    OperatorStop,
    PrepareLaunch,
    RankExited,
    RequestSave,
    RollbackRequested,
    Settings,
    Start,
    StopWorkers,
    SupervisorPhase,
    Tick,
    WorkersExited,
    WorkersRestarted,
    WorkersStarted,
    log,
)
from ftsup.supervisor.policy.events import Log as Log  # not used here, only by callers
from ftsup.supervisor.policy.events import RankFailure as RankFailure  # part of RankExited and WorkersExited
from ftsup.supervisor.policy.rules import (
    backoff_s,
    choose_world_size,
    hang_detection_on,
    heartbeat_timeout,
    made_progress,
    progress_timeout,
    save_fits,
)
from ftsup.supervisor.policy.saves import Eviction as Eviction  # the eviction in progress (`State.eviction`)

# Exit codes of `ftsup run` (documented in docs/supervising.md, Exit statuses).
EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_CRASH_LOOP = 3
EXIT_BUDGET = 4
EXIT_EVICTED = saves.EXIT_EVICTED  # 5
EXIT_STOPPED = 6
EXIT_ANOMALY = policy_anomaly.EXIT_ANOMALY  # 7: an anomaly escalated (`policy.anomaly`)
EXIT_SAVE_LOST = saves.EXIT_SAVE_LOST  # 8: evicted, its emergency save failed (`policy.saves`)
EXIT_NOT_DURABLE = 9  # finished, but the final checkpoint did not reach the durable tier it was to reach

ATTEMPT_PHASES = frozenset({SupervisorPhase.RUNNING, SupervisorPhase.STOPPING})  # an attempt's processes are up
STEP_HISTORY = 200


# ---------------------------------------------------------------------- state


@dataclass(frozen=True)
class RankView:
    last_beat: float  # when its newest beat was read
    step: int
    phase: Phase
    since: float = 0.0  # when it entered this phase
    mark: tuple[int, float] | None = None  # (step, rank's clock) where the step being timed began
    rank: int = -1  # its global rank, as its beats say


@dataclass(frozen=True)
class Attempt:
    number: int
    nproc: int
    resume_step: int | None
    launched_at: float
    started: bool = False
    ranks: tuple[tuple[int, RankView], ...] = ()
    max_step: int = -1
    progress_at: float = 0.0  # when max_step or since_restart last grew (or launch, or a restart in place)
    since_restart: int = -1  # the highest step its ranks reported since torchrun last restarted them in place
    best_before: int = -1  # the highest step any earlier attempt reached
    waited_until: float = -math.inf  # when a rank last left a long phase that the others may have waited for
    log: str | None = None  # its log file, named in its failure events
    ranks_at: float | None = None  # when torchrun started its ranks (its rendezvous over; `RanksStarted`)
    stopped_elsewhere: int | None = None  # the step its ranks stopped after at another node's request

    def rank_map(self) -> dict[int, RankView]:
        return dict(self.ranks)

    def reached(self) -> int | None:
        """The highest step it reported, for its events: None when it reported none (never `step -1`)."""
        return self.max_step if self.max_step >= 0 else None


@dataclass(frozen=True)
class State:
    phase: SupervisorPhase = SupervisorPhase.INIT
    attempt_no: int = 0
    attempt: Attempt | None = None
    stop_reason: str | None = None
    final: Exit | None = None  # set when the stop must end the daemon, not restart
    restarts: tuple[float, ...] = ()  # times of restarts inside the window
    failures_in_a_row: int = 0
    no_progress_streak: int = 0
    best_step: int = -1  # the highest step any attempt reached
    resume_at: float = 0.0
    step_times: tuple[float, ...] = ()  # carried across attempts for learned timeouts
    last_failure: str | None = None  # the reason of the newest error logged (job_failed, worker_exited, ...)
    last_launch: Launch | None = None  # the newest attempt launched (number, world size, resume step), kept after it
    save_times: tuple[float, ...] = ()  # measured save durations (s), newest last
    save_seq: int = 0  # the newest save request's number
    eviction: Eviction | None = None
    newest_checkpoint: int | None = None  # the newest step committed in the store, as the ranks and launches said
    beating: bool = False  # a heartbeat has arrived in this supervisor's life: heartbeat.mode auto detects hangs
    anomaly: policy_anomaly.AnomalyState = policy_anomaly.AnomalyState()  # training health, rollbacks, data skips
    standby_releases: int = 0  # a hot spare's rendezvous rounds in a row that ended without it (`policy.standby`)
    capturing: int | None = None  # the attempt whose evidence is captured before its stop (`policy.evidence`)


# ---------------------------------------------------------------------- the machine


def step(s: Settings, st: State, ev: Event, now: float) -> tuple[State, list[Action]]:
    """One transition. Unknown or stale events leave the state unchanged."""
    if st.phase == SupervisorPhase.DONE:
        return st, []
    if isinstance(ev, Start) and st.phase == SupervisorPhase.INIT:
        return _prepare(st, now)
    if isinstance(ev, OperatorStop):
        return _operator_stop(st, ev, now)
    if isinstance(ev, RollbackRequested):
        return _rollback_requested(st, ev, now)
    if evidence.handles(ev):  # a capture over, or an operator's request for one
        return evidence.on_event(s, st, ev)
    if (spare := standby.step(s, st, ev, now, EXIT_OK)) is not None:  # a hot spare waits, joins, is released
        return spare
    if isinstance(ev, LaunchReady) and st.phase == SupervisorPhase.PREPARING:
        return _launch(s, st, ev, now)
    att = st.attempt
    if isinstance(ev, WorkersStarted) and att and ev.attempt == att.number:
        return replace(st, attempt=replace(att, started=True, log=ev.log)), [
            log("workers_launched", attempt=att.number, world_size=att.nproc, resume_step=att.resume_step, log=ev.log)
        ]
    if isinstance(ev, WorkersRestarted) and att and ev.attempt == att.number and st.phase == SupervisorPhase.RUNNING:
        # Ranks restarted in place resume from a checkpoint: the steps they train again are progress for them.
        fresh = replace(st, attempt=replace(att, ranks=(), launched_at=now, progress_at=now, since_restart=-1))
        if not ev.new_ranks:
            return fresh, []
        return fresh, [log("workers_restarted", attempt=att.number, world_size=att.nproc, step=att.reached())]
    if isinstance(ev, Heartbeat) and att and ev.attempt == att.number and st.phase in ATTEMPT_PHASES:
        if not 0 <= ev.local_rank < att.nproc:
            return st, []  # a rank outside the attempt's is never waited for
        return _heartbeat_and_saves(s, st, att, ev, now)
    if isinstance(ev, EvictionNoticed):
        return _evict(s, st, ev, now)
    if isinstance(ev, RankExited) and att and ev.attempt == att.number and st.phase == SupervisorPhase.RUNNING:
        if ev.exitcode == 0 and not ev.signal:
            return st, []  # a rank finishing cleanly is not a failure; torchrun's exit decides
        reason, told = failures.rank_exited(ev)
        return _fail(st, att, reason, now, "worker_exited", pid=ev.pid, **told)
    if isinstance(ev, WorkersExited) and att and ev.attempt == att.number:
        return _exited(s, st, att, ev, now)
    if isinstance(ev, Tick):
        return _tick(s, st, ev, now)
    return st, []


def _prepare(st: State, now: float) -> tuple[State, list[Action]]:
    n = st.attempt_no + 1
    at_most = policy_anomaly.bound(st.anomaly)
    return replace(st, phase=SupervisorPhase.PREPARING, attempt_no=n, attempt=None), [PrepareLaunch(n, at_most)]


def _launch(s: Settings, st: State, ev: LaunchReady, now: float) -> tuple[State, list[Action]]:
    if ev.at_most != (at_most := policy_anomaly.bound(st.anomaly)):  # a rollback was asked for since: choose again
        return st, [PrepareLaunch(st.attempt_no, at_most)]
    blind = s.nproc_max if st.last_launch is None else st.last_launch.nproc  # a blind probe keeps the last size
    n, why = choose_world_size(s, blind if ev.healthy_slots is None else ev.healthy_slots, ev.batch_divisor)
    if n is None:
        return _give_up(st, [], Exit(EXIT_BUDGET, f"cannot launch: {why}"), "job_failed", attempt=st.attempt_no)
    if st.anomaly.pending is not None:  # progress is measured from a rollback's step: the steps after it are new
        st = replace(st, best_step=min(st.best_step, ev.resume_step or 0))
    att = Attempt(st.attempt_no, n, ev.resume_step, launched_at=now, progress_at=now, best_before=st.best_step)
    launch = Launch(st.attempt_no, n, standby.bound(s, ev), st.anomaly.skips, policy_anomaly.resume_bound(ev))
    anomaly = policy_anomaly.launched(st.anomaly, ev.resume_step, ev.resume_samples)
    st = replace(st, newest_checkpoint=ev.resume_step)  # the newest checkpoint is the one this attempt resumes from
    return replace(st, phase=SupervisorPhase.RUNNING, attempt=att, last_launch=launch, anomaly=anomaly), [
        log("world_size_chosen", attempt=st.attempt_no, world_size=n, reason=why, step=ev.resume_step),
        launch,
    ]


def _heartbeat(st: State, att: Attempt, ev: Heartbeat, now: float) -> State:
    ranks = att.rank_map()
    prev = ranks.get(ev.local_rank)
    sent = now if ev.sent is None else ev.sent
    step_times = st.step_times
    mark: tuple[int, float] | None = None
    if ev.phase == Phase.TRAIN:
        if prev is None or prev.phase != Phase.TRAIN or prev.mark is None:
            mark = (ev.step, sent)  # (back) in train: time steps from here, not across a save or a load
        elif ev.step > prev.mark[0]:
            per_step = (sent - prev.mark[1]) / (ev.step - prev.mark[0])
            # A step that spanned a peer's long phase was spent waiting for it in a collective: not a step time.
            waited = prev.last_beat < att.waited_until or any(r.phase in LONG_PHASES for r in ranks.values())
            if not waited and math.isfinite(per_step) and per_step > 0:
                step_times = (*step_times, per_step)[-STEP_HISTORY:]
            mark = (ev.step, sent)
        else:
            mark = prev.mark  # another beat within the same step
    since = prev.since if prev is not None and prev.phase == ev.phase else now
    ranks[ev.local_rank] = RankView(now, ev.step, ev.phase, since, mark, ev.rank)
    att = replace(att, ranks=tuple(sorted(ranks.items())), stopped_elsewhere=saves.elsewhere(att.stopped_elsewhere, ev))
    if prev is not None and prev.phase in LONG_PHASES and ev.phase not in LONG_PHASES:
        att = replace(att, waited_until=now)  # the ranks that waited for it in a collective beat again soon
    if ev.phase == Phase.TRAIN and ev.step > att.since_restart:  # max_step, but from -1 after a restart in place
        att = replace(att, max_step=max(att.max_step, ev.step), since_restart=ev.step, progress_at=now)
    elif ev.phase == Phase.TRAIN and prev is not None and prev.phase in LONG_PHASES:
        att = replace(att, progress_at=max(att.progress_at, now))  # time in a long phase is not a stall
    return replace(st, attempt=att, step_times=step_times, best_step=max(st.best_step, att.max_step))


def _heartbeat_and_saves(s: Settings, st: State, att: Attempt, ev: Heartbeat, now: float) -> tuple[State, list[Action]]:
    actions: list[Action] = []
    if st.phase == SupervisorPhase.RUNNING:
        st = replace(_heartbeat(st, att, ev, now), beating=True)
        if st.attempt is not None and att.max_step < 0 <= st.attempt.max_step:
            took = round(now - att.launched_at, 3)
            actions.append(log("first_step_reached", attempt=att.number, step=st.attempt.max_step, duration_s=took))
            actions += progress.on_first_step(att.number, st.attempt.max_step, att.resume_step, att.best_before)
        if ev.phase == Phase.TRAIN and st.final is None:  # an eviction's save or a stop goes first
            anomaly, logs, stop = policy_anomaly.on_beat(s.anomaly, st.anomaly, ev, att.number, now)
            captures = evidence.stragglers(s, att.number, st.anomaly, anomaly, ev.step)  # stacks; nothing stopped
            st = replace(st, anomaly=anomaly)
            actions += [*logs, *captures]
            if stop is not None:  # the attempt ends here (its beats after this are not for this function)
                return replace(
                    st,
                    phase=SupervisorPhase.STOPPING,
                    stop_reason=stop.reason,
                    final=stop.exit,
                    last_failure=stop.reason,
                ), [*actions, StopWorkers(att.number, stop.reason)]
    save_s = ev.figure("save_s")
    if save_s is not None and not (math.isfinite(save_s) and save_s >= 0):
        save_s = None  # a figure that was not a number at the rank
    if save_s is not None and ev.local_rank == 0:
        st = replace(st, save_times=(*st.save_times, save_s)[-20:])
    newest = saves.newest_committed(st.newest_checkpoint, ev)
    ej, told = saves.on_beat(st.eviction, ev, att.number, newest, save_s, now)
    return replace(st, newest_checkpoint=newest, eviction=ej), [*actions, *told]


def _evict(s: Settings, st: State, ev: EvictionNoticed, now: float) -> tuple[State, list[Action]]:
    att = st.attempt
    notice = log(
        "eviction_noticed",
        "warning",
        reason=f"{ev.source}: {ev.detail}",
        source=ev.source,
        deadline_in_s=round(ev.deadline - now, 3),
        attempt=st.attempt_no,
    )
    if ev.advisory:
        if st.phase != SupervisorPhase.RUNNING or att is None:
            return st, [notice]
        seq = st.save_seq + 1
        return replace(st, save_seq=seq), [
            notice,
            log("save_requested", attempt=att.number, reason=f"{ev.source}: {ev.detail}", stop=False),
            RequestSave(seq, False, f"{ev.source}: {ev.detail}", ev.deadline),
        ]
    if st.eviction is not None:
        return st, []  # one eviction at a time; later notices of it change nothing
    if att is not None and st.phase == SupervisorPhase.RUNNING and {r.phase for _, r in att.ranks} == {Phase.DONE}:
        # Training is over and its final checkpoint committed: let the job succeed, not be evicted.
        return st, [notice]
    exit_ = Exit(EXIT_EVICTED, f"evicted: {ev.source}: {ev.detail}")
    if st.phase == SupervisorPhase.STOPPING:
        return replace(st, final=exit_, eviction=Eviction(ev.source, ev.deadline, now, None)), [notice]
    if st.phase != SupervisorPhase.RUNNING or att is None or att.max_step < 0:
        # Nothing trained in this attempt since its checkpoint: nothing to save.
        base = replace(st, final=exit_, eviction=Eviction(ev.source, ev.deadline, now, None))
        if st.phase == SupervisorPhase.RUNNING and att is not None:
            why = "no training step since the last checkpoint" if att.ranks else progress.NO_EMERGENCY_SAVE
            return replace(base, phase=SupervisorPhase.STOPPING, stop_reason=exit_.reason), [
                notice,
                log("save_skipped", "info" if att.ranks else "warning", attempt=att.number, reason=why),
                StopWorkers(att.number, exit_.reason),
            ]
        return replace(base, phase=SupervisorPhase.DONE), [notice, exit_]
    fits, why = save_fits(s, st.step_times, st.save_times, now, ev.deadline, ev.state_bytes, ev.upload_s)
    if not fits:
        return replace(
            st,
            phase=SupervisorPhase.STOPPING,
            stop_reason=exit_.reason,
            final=exit_,
            eviction=Eviction(ev.source, ev.deadline, now, None),
        ), [
            notice,
            log(
                "save_skipped",
                "warning",
                attempt=att.number,
                step=att.max_step,
                reason=f"an emergency save would not finish before the deadline: {why}; "
                "the last committed checkpoint stays the resume point",
            ),
            AckEviction(ev.source),
            # Leave before the deadline: the grace to SIGKILL must end inside it.
            StopWorkers(att.number, exit_.reason, grace_s=max(0.5, ev.deadline - now - s.stop_margin_s)),
        ]
    seq = st.save_seq + 1
    return replace(st, save_seq=seq, final=exit_, eviction=Eviction(ev.source, ev.deadline, now, seq)), [
        notice,
        log("save_requested", attempt=att.number, step=att.max_step, reason=f"{ev.source}: {why}", stop=True),
        RequestSave(seq, True, f"{ev.source}: {ev.detail}", ev.deadline),
    ]


def _fail(st: State, att: Attempt, reason: str, now: float, event: str, **fields: object) -> tuple[State, list[Action]]:
    if st.phase != SupervisorPhase.RUNNING:
        return st, []
    told = {"log": att.log} | fields
    return replace(st, phase=SupervisorPhase.STOPPING, stop_reason=reason, last_failure=reason), [
        log(event, "error", attempt=att.number, world_size=att.nproc, reason=reason, step=att.reached(), **told),
        StopWorkers(att.number, reason),
    ]


def _operator_stop(st: State, ev: OperatorStop, now: float) -> tuple[State, list[Action]]:
    exit_ = Exit(EXIT_STOPPED, f"stopped: {ev.reason}")
    if st.phase == SupervisorPhase.RUNNING and st.attempt:
        return replace(st, phase=SupervisorPhase.STOPPING, stop_reason=exit_.reason, final=exit_), [
            log("stop_requested", attempt=st.attempt.number, reason=ev.reason),
            StopWorkers(st.attempt.number, exit_.reason),
        ]
    if st.phase == SupervisorPhase.STOPPING:
        return replace(st, final=exit_), []
    return replace(st, phase=SupervisorPhase.DONE, final=exit_), [log("job_stopped", reason=ev.reason), exit_]


def _rollback_requested(st: State, ev: RollbackRequested, now: float) -> tuple[State, list[Action]]:
    """An operator's rollback: stop the attempt (if one runs); the next launch resumes from step `to_step` or
    before. A job that is ending leaves the request to the next `ftsup run` (it is not served)."""
    if st.phase == SupervisorPhase.DONE or st.final is not None:
        return st, []
    att = st.attempt if st.phase == SupervisorPhase.RUNNING else None
    anomaly, actions = policy_anomaly.operator(st.anomaly, ev, st.attempt_no)
    st = replace(st, anomaly=anomaly)
    if att is None or anomaly.pending is None:
        return st, list(actions)
    why = anomaly.pending.reason
    return replace(st, phase=SupervisorPhase.STOPPING, stop_reason=why), [*actions, StopWorkers(att.number, why)]


def _tick(s: Settings, st: State, ev: Tick, now: float) -> tuple[State, list[Action]]:
    if st.phase == SupervisorPhase.BACKOFF and (now >= st.resume_at or st.anomaly.pending is not None):
        return _prepare(st, now)
    att = st.attempt
    if st.phase != SupervisorPhase.RUNNING or att is None:
        return st, []
    ej = st.eviction
    if ej is not None:
        # Saving for an eviction: the usual timeouts are off (a save is long, the ranks then
        # exit on their own); what counts is leaving before the deadline.
        if now >= ej.deadline - s.stop_margin_s:
            why = "the eviction deadline is here"
            if ej.committed_step is None:
                why += " before the save committed"
            return replace(st, phase=SupervisorPhase.STOPPING, stop_reason=why), [
                log("stop_requested", "warning", attempt=att.number, reason=why),
                StopWorkers(att.number, why, grace_s=max(0.2, ej.deadline - now - 0.2)),
            ]
        return st, []
    if not hang_detection_on(s, st.beating):
        return st, []  # heartbeat.mode: crashes only (torchrun's exit, a rank gone)
    ranks = att.rank_map()
    long = any(r.phase in LONG_PHASES for r in ranks.values())
    training = [r for r in ranks.values() if r.phase == Phase.TRAIN]
    if not training:  # still starting up (or loading: that has its own, longer timeout)
        if now - standby.startup_from(s, att) > s.startup_timeout_s and not long:
            why = f"no training step within startup_timeout_s={s.startup_timeout_s:g}"
            return evidence.first(s, "startup_timed_out", _fail(st, att, why, now, "startup_timed_out"))
    hb = heartbeat_timeout(s, st.step_times)
    hang = hangs.find(s, ranks, now, hb, waited_until=att.waited_until, states=dict(ev.states))
    if hang is not None:  # the rank that stopped first is blamed, the others named as waiting for it
        return evidence.first(s, hang.event, _fail(st, att, hang.reason, now, hang.event, **hang.fields()), hang)
    every_rank = s.heartbeat_mode == HeartbeatMode.REQUIRED  # auto watches the ranks that beat, such as rank 0 alone
    if every_rank and training and len(ranks) < att.nproc and hb is not None and now - att.progress_at > hb:
        missing = sorted(set(range(att.nproc)) - set(ranks))
        why = f"local ranks {missing} never sent a heartbeat"
        return evidence.first(s, "heartbeat_timed_out", _fail(st, att, why, now, "heartbeat_timed_out"))
    pt = progress_timeout(s, st.step_times)
    if pt is not None and training and not long and not any(r.phase in QUIET_PHASES for r in ranks.values()):
        if now - att.progress_at > pt:
            why = f"no step progress for {now - att.progress_at:.1f}s (timeout {pt:.1f}s)"
            failed = _fail(st, att, why, now, "progress_timed_out", timeout_s=round(pt, 3))
            return evidence.first(s, "progress_timed_out", failed)
    return st, []


def _exited(s: Settings, st: State, att: Attempt, ev: WorkersExited, now: float) -> tuple[State, list[Action]]:
    if st.final is not None:
        ej, final = st.eviction, st.final
        said: list[Action] = []
        if ej is not None:  # exit 8 when its save was asked for and never committed
            seen = bool(st.save_times) or st.newest_checkpoint is not None  # a save path: the engine's figures
            ej, said, final = saves.at_exit(
                ej, final, att.number, st.newest_checkpoint, att.max_step, st.stop_reason, saves_seen=seen
            )
        return replace(st, phase=SupervisorPhase.DONE, attempt=None, eviction=ej, final=final), [
            *said,
            log("job_stopped", attempt=att.number, reason=final.reason),
            final,
        ]
    if st.anomaly.pending is not None:  # a rollback: relaunched at once; the rollback budget bounds how often
        return _prepare(replace(st, stop_reason=None), now)
    if st.phase == SupervisorPhase.RUNNING and ev.exitcode == 0 and att.stopped_elsewhere is not None:
        st, prepare = _prepare(replace(st, stop_reason=None), now)  # not finished: it rejoins the job at once
        return st, [saves.rejoining(att.number, att.stopped_elsewhere), *prepare]
    if st.phase == SupervisorPhase.RUNNING and ev.exitcode == 0:
        exit_ = Exit(EXIT_OK, "training command exited 0")
        return replace(st, phase=SupervisorPhase.DONE, attempt=None, final=exit_), [
            log("job_succeeded", attempt=att.number, world_size=att.nproc, step=att.reached()),
            exit_,
        ]
    running = st.phase == SupervisorPhase.RUNNING
    reason = failures.exited_reason(ev) if running else st.stop_reason or "stopped"
    told = failures.exited_fields(ev, att.log) if running else {"log": att.log}  # the cause, for every line below
    actions: list[Action] = (
        [log("worker_exited", "error", attempt=att.number, reason=reason, step=att.reached(), **told)]
        if running
        else []
    )
    # Progress means reaching a step no earlier attempt reached (`rules.made_progress`): a job
    # that dies at the same step every time is a crash loop, however often it restarts.
    progressed = made_progress(
        s,
        max_step=att.max_step,
        best_before=att.best_before,
        resume_step=att.resume_step,
        detecting=hang_detection_on(s, st.beating),
        ran_s=now - att.launched_at,
    )
    streak = 0 if progressed else st.no_progress_streak + 1
    in_a_row = 1 if progressed else st.failures_in_a_row + 1
    restarts = tuple(t for t in st.restarts if now - t < s.window_s)
    cannot_start = failures.startup_failure(ev) if running and not progressed else None  # no restart fixes it
    if streak >= s.max_attempts_without_progress or cannot_start:
        exit_ = Exit(EXIT_CRASH_LOOP, failures.crash_loop_reason(streak, reason, cannot_start))
        return _give_up(st, actions, exit_, "crash_loop_detected", attempt=att.number, step=att.reached(), **told)
    if len(restarts) >= s.max_restarts:
        exit_ = Exit(EXIT_BUDGET, f"restart budget spent: {len(restarts)} restarts within {s.window_s:g}s ({reason})")
        return _give_up(st, actions, exit_, "restart_budget_exhausted", attempt=att.number, **told)
    wait = backoff_s(s, in_a_row)
    return replace(
        st,
        phase=SupervisorPhase.BACKOFF,
        attempt=None,
        stop_reason=None,
        restarts=(*restarts, now),
        failures_in_a_row=in_a_row,
        no_progress_streak=streak,
        resume_at=now + wait,
        last_failure=reason,
    ), [*actions, log("restart_scheduled", attempt=att.number, reason=reason, duration_s=round(wait, 3))]


def _give_up(st: State, actions: list[Action], exit_: Exit, event: str, **fields: object) -> tuple[State, list[Action]]:
    """End the job after `actions`: the exit's reason is the event's and the journal's `last_failure`."""
    done = replace(st, phase=SupervisorPhase.DONE, attempt=None, final=exit_, last_failure=exit_.reason)
    return done, [*actions, log(event, "error", reason=exit_.reason, **fields), exit_]


@dataclass(frozen=True)
class Machine:
    """Convenience holder: the settings and current state, advanced by `feed`."""

    settings: Settings
    state: State = field(default_factory=State)

    def feed(self, ev: Event, now: float) -> tuple[Machine, list[Action]]:
        st, actions = step(self.settings, self.state, ev, now)
        return replace(self, state=st), actions
