"""Evidence before the kill, pure: when the policy asks for every rank's stacks and state to be captured, and the
stop a capture goes before (docs/incidents.md, Hangs: the evidence before the kill).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ftsup.supervisor.policy.events import (
    Action,
    CaptureEvidence,
    CaptureRequested,
    Event,
    EvidenceCaptured,
    Settings,
    StopWorkers,
    SupervisorPhase,
    log,
)
from ftsup.supervisor.policy.hangs import Hang

if TYPE_CHECKING:
    from ftsup.supervisor.policy.anomaly import AnomalyState
    from ftsup.supervisor.policy.machine import State

TRIGGERS = ("hang", "straggler", "operator", "anomaly")  # what an incident was recorded for (`ftsup incidents`)


def first(
    s: Settings, event: str, stopped: tuple[State, list[Action]], hang: Hang | None = None
) -> tuple[State, list[Action]]:
    """A hung attempt's stop (`stopped`: the state and actions of a failure ending in its StopWorkers) with the
    evidence captured before it. The state says that a capture is under way (`State.capturing`: its time is
    `detection`) until `EvidenceCaptured`. `hang` is whom the policy blamed, when it named a rank."""
    st, actions = stopped
    stop = actions[-1] if actions else None
    if not s.forensics.enabled or not isinstance(stop, StopWorkers):
        return st, actions
    att = st.attempt
    capture = CaptureEvidence(
        stop.attempt,
        "hang",
        event,
        stop.reason,
        s.forensics.timeout_s,
        rank=hang.rank if hang else None,
        local_rank=hang.local_rank if hang else None,
        state=hang.state if hang else None,
        waiting=hang.waiting if hang else (),
        step=att.reached() if att is not None else None,
    )
    return replace(st, capturing=stop.attempt), [*actions[:-1], capture, stop]


def handles(ev: Event) -> bool:
    return isinstance(ev, CaptureRequested | EvidenceCaptured)


def on_event(s: Settings, st: State, ev: Event) -> tuple[State, list[Action]]:
    """A capture over (what it held back goes on), or an operator's request for one (served while an attempt runs;
    nothing is stopped)."""
    if isinstance(ev, EvidenceCaptured):
        return (replace(st, capturing=None) if st.capturing == ev.attempt else st), []
    if not isinstance(ev, CaptureRequested):
        return st, []
    att = st.attempt
    who = f"{ev.who}: {ev.reason}" if ev.reason else ev.who or "operator"
    if st.phase != SupervisorPhase.RUNNING or att is None:
        why = f"{who}: no attempt is running (phase {st.phase})"
        return st, [log("capture_request_ignored", "warning", attempt=st.attempt_no, reason=why, id=ev.id)]
    step = att.reached()
    return st, [
        log("capture_requested", attempt=att.number, reason=who, id=ev.id, step=step),
        CaptureEvidence(att.number, "operator", "capture_requested", who, s.forensics.timeout_s, step=step),
    ]


def stragglers(s: Settings, attempt: int, before: AnomalyState, after: AnomalyState, step: int) -> list[Action]:
    """A capture of the stacks when a rank is newly reported as a straggler (`forensics.on_straggler`), naming it."""
    if not (s.forensics.enabled and s.forensics.on_straggler):
        return []
    was = {local for local, t in before.health.ranks if t.reported}
    new = sorted((local, t.rank) for local, t in after.health.ranks if t.reported and local not in was)
    if not new:
        return []
    local, rank = new[0]
    why = f"rank {rank} reported as a straggler"
    return [
        CaptureEvidence(attempt, "straggler", "straggler_detected", why, s.forensics.timeout_s, rank, local, step=step)
    ]
