"""Goodput accounting: every second of a job's wall time attributed exactly once, productive or to one cause.

A pure accountant beside the policy (DESIGN.md, Goodput accounting); what each cause counts: docs/design/policy.md,
Goodput causes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ftsup.protocol import Phase
from ftsup.supervisor.policy.events import (
    Event,
    Heartbeat,
    RankExited,
    SupervisorPhase,
    Tick,
    WorkersExited,
    WorkersRestarted,
)
from ftsup.supervisor.policy.machine import State

CAUSES = (
    "startup",
    "checkpoint_load",
    "checkpoint_save",
    "wasted_progress",
    "detection",
    "backoff",
    "eviction",
    "other",
)
"""The badput causes, the `cause` label of `ftsup_badput_seconds_total` (DESIGN.md, Contracts)."""

TRAIN = "train"  # an activity, not a cause: its time is productive or wasted_progress once a step completes
ENDED = "ended"  # the job ended: no time accrues
ACTIVITIES = (*CAUSES, TRAIN, ENDED)
SAVED_VERSION = 1
_EAGER = frozenset({SupervisorPhase.INIT, SupervisorPhase.PREPARING, SupervisorPhase.BACKOFF, SupervisorPhase.STOPPING})
"""Phases without ranks to fail: their time is attributed as it passes."""
UNCOUNTED_AFTER = frozenset({"succeeded", "stopped"})
"""Journal statuses after which the time until the next start is not the job's."""
_MAX_SECONDS = 1e12


@dataclass(frozen=True)
class Totals:
    """Seconds attributed: productive, and badput by cause (in the order of CAUSES)."""

    productive_s: float = 0.0
    badput: tuple[float, ...] = (0.0,) * len(CAUSES)

    def add(self, cause: str, seconds: float) -> Totals:
        if seconds <= 0:
            return self
        if cause == "productive":
            return replace(self, productive_s=self.productive_s + seconds)
        i = CAUSES.index(cause)
        return replace(self, badput=(*self.badput[:i], self.badput[i] + seconds, *self.badput[i + 1 :]))

    def badput_s(self) -> dict[str, float]:
        return dict(zip(CAUSES, self.badput, strict=True))

    @property
    def wall_s(self) -> float:
        return self.productive_s + sum(self.badput)

    @property
    def ratio(self) -> float:
        """Productive over wall time (0 before any time is attributed)."""
        wall = self.wall_s
        return self.productive_s / wall if wall > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The shape `ftsup status --json` shows (DESIGN.md, Contracts)."""
        badput = {c: round(s, 3) for c, s in self.badput_s().items()}
        return {
            "productive_s": round(self.productive_s, 3),
            "badput_s": badput,
            "wall_s": round(self.wall_s, 3),
            "ratio": round(self.ratio, 6),
        }


@dataclass(frozen=True)
class Accounting:
    totals: Totals = field(default_factory=Totals)
    cursor: float | None = None  # the policy's clock: every second before it is attributed
    activity: str = "startup"  # what the time since the cursor is (ACTIVITIES)
    high_water: int = -1  # the highest step the job completed, in any attempt of any supervisor
    save_since_step: float = 0.0  # save time attributed since the last step completed (for `save_s`)
    started_unix: float | None = None  # when the job's accounting began
    gone: bool = False  # the attempt's ranks are gone and torchrun has not exited yet: the activity stays


def start(now: float, wall: float) -> Accounting:
    """A job's accounting from its first start."""
    return Accounting(cursor=now, started_unix=wall)


# ---------------------------------------------------------------------- what the policy's states say


def activity(st: State) -> str:
    """What the time from `st` on is (one of ACTIVITIES), as the policy's state and the ranks' phases say."""
    if st.phase == SupervisorPhase.DONE:
        return ENDED
    if st.phase == SupervisorPhase.BACKOFF:
        return "backoff"
    evicting = st.eviction is not None
    if st.phase == SupervisorPhase.STOPPING:  # a hang's evidence, captured before its stop, is part of detecting it
        return "eviction" if evicting else "detection" if st.capturing is not None else "other"
    if st.phase != SupervisorPhase.RUNNING or st.attempt is None:
        return "startup"
    phases = {view.phase for _, view in st.attempt.ranks}
    if Phase.SAVE in phases:
        doing = "checkpoint_save"
    elif Phase.LOAD in phases:
        doing = "checkpoint_load"
    elif Phase.EVAL in phases or (Phase.DONE in phases and Phase.TRAIN not in phases):
        doing = "other"  # a rank done while another still trains: a failure's teardown, or the end's, not yet idle
    elif Phase.TRAIN in phases:
        doing = TRAIN
    else:  # no rank heard yet, or all of them still in init
        doing = "startup"
    return "eviction" if evicting and doing != TRAIN else doing


def _failed(ev: Event) -> str | None:
    """How an attempt that ended on `ev` failed: "hang" (a timeout, fed as a tick), "crash", or None (not a
    failure: an operator's stop or rollback, an eviction, a clean exit)."""
    if isinstance(ev, Tick):
        return "hang"
    if isinstance(ev, (RankExited, Heartbeat)) or (isinstance(ev, WorkersExited) and ev.exitcode != 0):
        return "crash"  # a beat that ends an attempt is an anomaly: detected on the step it came with
    return None


# ---------------------------------------------------------------------- the accountant


def feed(acc: Accounting, before: State, after: State, ev: Event, now: float) -> Accounting:
    """The accounting after the policy went from `before` to `after` on `ev` at `now`."""
    if acc.activity == ENDED:
        return acc
    if acc.cursor is None:
        return replace(acc, cursor=now, activity=activity(after))
    now = max(now, acc.cursor)  # a clock that went back attributes nothing twice
    nxt = _next_step(before)
    acc = _steps(acc, before, after, ev, now)
    acc = _save_figure(acc, before, ev, now)
    evicting = after.eviction is not None
    if before.phase == SupervisorPhase.RUNNING and after.phase != SupervisorPhase.RUNNING:
        how = _failed(ev)
        if evicting:
            cause = "eviction"
        elif how == "hang" or (how == "crash" and acc.activity == TRAIN):
            cause = "detection"
        else:  # a stop, a rollback, a clean exit; a crash while starting, loading or saving
            cause = "other" if acc.activity == TRAIN else acc.activity
        acc = _attribute(acc, cause, now, nxt)
    elif isinstance(ev, WorkersRestarted) and ev.new_ranks and acc.activity == TRAIN:
        acc = _attribute(acc, "detection", now, nxt)  # torchrun replaced its ranks: the step in flight is lost
    if isinstance(ev, WorkersRestarted) or after.phase != SupervisorPhase.RUNNING:
        # Ranks gone before torchrun's exit: what they were doing goes on until the exit says how they ended.
        acc = replace(acc, gone=isinstance(ev, WorkersRestarted) and not ev.new_ranks)
    new = acc.activity if acc.gone else activity(after)
    settled = _ranks_done(after) or (acc.gone and acc.activity in ("other", "eviction"))  # nothing left to fail
    if new != acc.activity or after.phase in _EAGER or settled:
        acc = _attribute(acc, acc.activity, now, nxt)
    elif _sign_of_life(ev, after) and acc.activity != TRAIN:
        acc = _attribute(acc, acc.activity, now, nxt)  # the time until then is not detection
    return replace(acc, activity=new)


def _sign_of_life(ev: Event, st: State) -> bool:
    """A heartbeat of the running attempt (one of an earlier attempt, read late, says nothing of this one)."""
    att = st.attempt
    running = st.phase == SupervisorPhase.RUNNING and att is not None
    return running and isinstance(ev, Heartbeat) and att is not None and ev.attempt == att.number


def _ranks_done(st: State) -> bool:
    """Every rank heard is done: torchrun is ending."""
    return st.attempt is not None and bool(st.attempt.ranks) and all(v.phase == Phase.DONE for _, v in st.attempt.ranks)


def _next_step(st: State) -> int:
    """The step the running attempt trains now (the one after its last completed, or after its resume step)."""
    att = st.attempt
    if att is None:
        return 0
    return (att.max_step if att.max_step >= 0 else att.resume_step or 0) + 1


def _attribute(acc: Accounting, what: str, now: float, next_step: int) -> Accounting:
    """Attribute the time from the cursor to `now` to `what` (an activity); the cursor moves to `now`."""
    assert acc.cursor is not None
    seconds = max(0.0, now - acc.cursor)
    if what == TRAIN:  # part of a step not completed yet: the step decides
        what = "wasted_progress" if next_step <= acc.high_water else "productive"
    if what == ENDED:
        seconds = 0.0
    saved = acc.save_since_step + (seconds if what in ("checkpoint_save", "eviction") else 0.0)
    return replace(acc, totals=acc.totals.add(what, seconds), cursor=now, save_since_step=saved)


def _steps(acc: Accounting, before: State, after: State, ev: Event, now: float) -> Accounting:
    """A heartbeat that completed steps (the attempt's highest step grew): the time since the cursor is theirs,
    productive for steps above the high-water step and wasted_progress for the others. Coming from another
    activity (the attempt's first step), only the step's own `step_s` is; the rest is that activity's."""
    b, a = before.attempt, after.attempt
    if not isinstance(ev, Heartbeat) or a is None or b is None or a.number != b.number or a.max_step <= b.max_step:
        return acc
    assert acc.cursor is not None
    first = _next_step(before)
    done = a.max_step - first + 1  # steps first..max_step
    if done <= 0:
        return acc
    pending = max(0.0, now - acc.cursor)
    took = pending
    if acc.activity != TRAIN:
        step_s = ev.figure("step_s")
        took = min(pending, step_s) if step_s is not None and math.isfinite(step_s) and step_s > 0 else 0.0
        acc = _attribute(acc, acc.activity, now - took, first)
    again = max(0, min(a.max_step, acc.high_water) - first + 1)
    totals = acc.totals.add("wasted_progress", took * again / done).add("productive", took * (done - again) / done)
    return replace(acc, totals=totals, cursor=now, high_water=max(acc.high_water, a.max_step), save_since_step=0.0)


def _save_figure(acc: Accounting, before: State, ev: Event, now: float) -> Accounting:
    """Rank 0's `save_s` (the engine's measure of a save it just finished): what the phase `save` did not already
    count since the last step is a save too, taken from the time since the cursor."""
    if not isinstance(ev, Heartbeat) or ev.local_rank != 0 or before.phase != SupervisorPhase.RUNNING:
        return acc
    save_s = ev.figure("save_s")
    if save_s is None or not (math.isfinite(save_s) and save_s > 0):
        return acc
    assert acc.cursor is not None
    extra = min(save_s - acc.save_since_step, now - acc.cursor)
    if extra <= 0:
        return acc
    cause = "eviction" if before.eviction is not None else "checkpoint_save"
    return replace(
        acc, totals=acc.totals.add(cause, extra), cursor=acc.cursor + extra, save_since_step=acc.save_since_step + extra
    )


# ---------------------------------------------------------------------- across supervisors


@dataclass(frozen=True)
class Saved:
    """The accounting as the journal keeps it (`goodput`): the totals up to `as_of_unix`, the high-water step, the
    activity then, when the job's accounting began."""

    totals: Totals
    as_of_unix: float
    high_water: int = -1
    activity: str = "startup"
    started_unix: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "v": SAVED_VERSION,
            "productive_s": self.totals.productive_s,
            "badput_s": self.totals.badput_s(),
            "as_of_unix": self.as_of_unix,
            "high_water_step": self.high_water,
            "activity": self.activity,
            "started_unix": self.started_unix,
        }

    @classmethod
    def from_json(cls, raw: object) -> Saved:
        """Check every field (a journal is hostile input); ValueError naming the first bad one."""
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        unknown = sorted(
            set(raw) - {"v", "productive_s", "badput_s", "as_of_unix", "high_water_step", "activity", "started_unix"}
        )
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}")
        if raw.get("v") != SAVED_VERSION:
            raise ValueError(f"'v' must be {SAVED_VERSION}, got {raw.get('v')!r}")
        badput = raw.get("badput_s", {})
        if not isinstance(badput, dict) or not set(badput) <= set(CAUSES):
            raise ValueError(f"'badput_s' must map causes ({', '.join(CAUSES)}) to seconds")
        totals = Totals(_seconds(raw, "productive_s"), tuple(_seconds(badput, c, "badput_s") for c in CAUSES))
        hw = raw.get("high_water_step", -1)
        if isinstance(hw, bool) or not isinstance(hw, int) or not -1 <= hw < 1 << 62:
            raise ValueError(f"'high_water_step' must be a step (or -1), got {hw!r}")
        act = raw.get("activity", "startup")
        if act not in ACTIVITIES:
            raise ValueError(f"'activity' must be one of {', '.join(ACTIVITIES)}, got {act!r:.40}")
        started = None if raw.get("started_unix") is None else _seconds(raw, "started_unix")
        return cls(totals, _seconds(raw, "as_of_unix"), hw, act, started)


def _seconds(raw: dict[str, Any], key: str, within: str = "") -> float:
    v = raw.get(key, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < _MAX_SECONDS:
        where = f"{within}.{key}" if within else key
        raise ValueError(f"{where!r} must be a number of seconds, got {v!r:.40}")
    return float(v)


def snapshot(acc: Accounting, now: float, wall: float) -> Saved:
    """What to persist at `now` (the policy's clock), `wall` being the Unix time at the same instant: the totals
    up to the cursor (the time since it is not attributed yet)."""
    behind = 0.0 if acc.cursor is None else max(0.0, now - acc.cursor)
    return Saved(acc.totals, wall - behind, acc.high_water, acc.activity, acc.started_unix)


def resumed(saved: Saved | None, status: str | None, now: float, wall: float) -> Accounting:
    """The accounting a supervisor starting at `now` (Unix time `wall`) takes up from the journal's `saved` (None:
    a new job), whose status was `status`: the time since the snapshot is `eviction` after an eviction (or while
    one was being served), nothing after success or an operator's stop, `other` otherwise (a supervisor that
    died, or exited to be restarted)."""
    if saved is None:
        return start(now, wall)
    gap = max(0.0, wall - saved.as_of_unix)
    if status == "evicted" or saved.activity == "eviction":
        totals = saved.totals.add("eviction", gap)
    elif status in UNCOUNTED_AFTER:
        totals = saved.totals
    else:
        totals = saved.totals.add("other", gap)
    started = saved.started_unix if saved.started_unix is not None else saved.as_of_unix
    return Accounting(totals, cursor=now, high_water=saved.high_water, started_unix=started)
