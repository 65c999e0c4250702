"""Hangs, pure: whose silence is a hang, given what the other ranks are doing, and which rank is to blame.

A rank blocked in a collective while a peer is in a long phase is waiting, not hung; the culprit is the rank that
stopped first (docs/design/policy.md, Hangs and blame).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ftsup.protocol import LONG_PHASES, SLOW_PHASES, Phase
from ftsup.supervisor.policy.events import Settings

GONE = "gone"  # a rank's process state when its process is no more (`events.Tick.states`)
# Process states (the letter of /proc/PID/stat) that say a rank cannot be waiting for anyone: it is not running.
STUCK = {
    "T": "stopped (SIGSTOP/state T)",
    "t": "stopped by a tracer (state t)",
    "Z": "gone (state Z)",
    "X": "gone (state X)",
    GONE: "gone",
}
BLOCKED = {"D": "in uninterruptible sleep (state D)"}  # running no Python, maybe on a device or a filesystem
MAX_NAMED = 8  # waiting ranks named in a reason


class View(Protocol):
    """A rank as the policy last heard it (`machine.RankView`)."""

    @property
    def last_beat(self) -> float: ...
    @property
    def step(self) -> int: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def since(self) -> float: ...
    @property
    def rank(self) -> int: ...


@dataclass(frozen=True)
class Hang:
    """The attempt is hung: the event that says so, its reason and the rank blamed."""

    event: str  # heartbeat_timed_out, or progress_timed_out for a rank beating yet stuck in eval
    reason: str
    rank: int  # the culprit: its global rank where its beats named one, else its local rank
    local_rank: int
    timeout_s: float
    state: str | None = None  # the culprit's process state, where the daemon read one
    waiting: tuple[int, ...] = ()  # the other ranks silent meanwhile, taken to wait for the culprit

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "local_rank": self.local_rank, "timeout_s": round(self.timeout_s, 3)}
        if self.state is not None:
            out["state"] = self.state
        if self.waiting:
            out["waiting"] = list(self.waiting)
        return out


def limit(s: Settings, phase: Phase, hb: float | None) -> float | None:
    """The silence a rank in `phase` may keep on its own (None: not watched). `save` and `load` may be silent up to
    `save_timeout_s`; `eval` beats from a thread, so it has the heartbeat timeout (`save_timeout_s` until one is
    learned), as `train` has."""
    if phase in SLOW_PHASES or (phase == Phase.EVAL and hb is None):
        return s.save_timeout_s
    return hb if phase in (Phase.TRAIN, Phase.EVAL) else None


def find(
    s: Settings,
    views: Mapping[int, View],
    now: float,
    hb: float | None,
    *,
    waited_until: float = -math.inf,
    states: Mapping[int, str] | None = None,
) -> Hang | None:
    """The hang among `views` (by local rank), or None.

    A rank in a long phase (`eval`, `save`, `load`) within its own limit holds the others up: a rank in `train` that
    is silent meanwhile is waiting for it in a collective, and may be silent up to `save_timeout_s`, unless its
    process state says it runs nothing (stopped, gone). After the last long phase ended (`waited_until`) a waiting
    rank has the heartbeat timeout again to send its next beat. `states` are the ranks' process states (a
    `/proc/PID/stat` letter or `GONE`), by local rank; a rank missing there is not known."""
    states = states or {}
    own = {r: limit(s, v.phase, hb) for r, v in views.items()}
    holders = {
        r
        for r, v in views.items()
        if v.phase in LONG_PHASES and (lim := own[r]) is not None and now - v.last_beat <= lim
    }
    silence: dict[int, tuple[float, float]] = {}  # rank -> (silent for, its limit now)
    for r, v in views.items():
        lim = own[r]
        if lim is None:
            continue
        if v.phase == Phase.TRAIN:
            if holders - {r} and states.get(r) not in STUCK:
                lim = max(lim, s.save_timeout_s)
            silence[r] = (now - max(v.last_beat, waited_until), lim)
        else:
            silence[r] = (now - v.last_beat, lim)
    over = [r for r, (silent, lim) in silence.items() if silent > lim]
    if over:
        return _blame(views, states, silence, own, set(over), now)
    for r, v in sorted(views.items()):
        if v.phase == Phase.EVAL and now - v.since > s.save_timeout_s:  # beating, yet stuck in eval
            why = f"rank {_name(r, v)} in phase eval for {now - v.since:.1f}s (timeout {s.save_timeout_s:g}s)"
            return Hang("progress_timed_out", why, _name(r, v), r, s.save_timeout_s)
    return None


def _blame(
    views: Mapping[int, View],
    states: Mapping[int, str],
    silence: Mapping[int, tuple[float, float]],
    own: Mapping[int, float | None],
    over: set[int],
    now: float,
) -> Hang:
    """The rank that stopped first, among those over their limit, those whose process runs nothing and those in
    `train` silent for half of the heartbeat timeout (blocked, as a rank that waits in a collective is): one whose
    process runs nothing (stopped, gone), then one in uninterruptible sleep, then one in a long phase (the others
    wait for it in a collective it never joined), then the one behind in steps (its peers finished the collective
    that it has not reported past), then the oldest last beat. The other candidates are named as waiting."""

    def silent_long(r: int) -> bool:
        base = own[r]
        blocked = views[r].phase == Phase.TRAIN and base is not None and silence[r][0] > base / 2
        return r in over or blocked or states.get(r) in STUCK

    def order(r: int) -> tuple[int, int, int, float, int]:
        state = states.get(r)
        kind = 0 if state in STUCK else 1 if state in BLOCKED else 2
        v = views[r]
        return kind, 0 if v.phase in LONG_PHASES else 1, v.step, v.last_beat, r

    candidates = sorted((r for r in silence if silent_long(r)), key=order)
    culprit, others = candidates[0], candidates[1:]
    v, (silent, lim) = views[culprit], silence[culprit]
    state = states.get(culprit)
    said = STUCK.get(state or "") or BLOCKED.get(state or "")
    where = "" if v.phase == Phase.TRAIN else f" in phase {v.phase}"
    why = f"rank {_name(culprit, v)} " + (f"{said}, " if said else "")
    waited = f", {silent:.1f}s since the long phase it waited for ended" if now - v.last_beat > silent + 0.05 else ""
    why += f"silent for {now - v.last_beat:.1f}s{waited}{where} (timeout {lim:.1f}s)"
    waiting = tuple(_name(r, views[r]) for r in others)
    if waiting:
        named = ", ".join(str(r) for r in waiting[:MAX_NAMED]) + (", ..." if len(waiting) > MAX_NAMED else "")
        why += f"; rank{'s' if len(waiting) > 1 else ''} {named} waiting"
    return Hang("heartbeat_timed_out", why, _name(culprit, v), culprit, lim, state, waiting)


def _name(local_rank: int, v: View) -> int:
    return v.rank if v.rank >= 0 else local_rank
