"""The policy's rules for training health: what a finding of the detectors leads to (a rollback, an escalation).

Pure: `machine.step` calls these and applies what they return (docs/design/policy.md, Training health).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ftsup.protocol import MAX_DATA_SKIPS, DataSkips
from ftsup.supervisor.config.anomaly import AnomalyConfig
from ftsup.supervisor.policy import detectors
from ftsup.supervisor.policy.events import Exit, Heartbeat, LaunchReady, Log, RollbackRequested, WriteJournal, log

EXIT_ANOMALY = 7
MAX_SERVED = 64  # request ids remembered: a request is served once, and a file holds one request at a time

Skips = DataSkips


def merge_skips(*groups: Skips) -> Skips:
    """The union of data skips, sorted, overlapping or touching ranges joined (it may hold more than
    MAX_DATA_SKIPS: the caller refuses what the ranks would)."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(r for g in groups for r in g):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return tuple(merged)


@dataclass(frozen=True)
class Rollback:
    """A rollback decided: the next resume is from a checkpoint of a step at most `at_most`."""

    at_most: int
    trigger: str  # auto | operator
    reason: str


@dataclass(frozen=True)
class Incident:
    """The last anomaly or operator rollback, as `ftsup status` shows it."""

    kind: str  # one of detectors.KINDS, or operator
    step: int | None
    onset_step: int | None
    value: float | None
    rollback_to: int | None  # the resume bound; None: escalated
    skips: Skips  # the skip it added
    reason: str
    resumed_from: int | None = None  # the step the rollback's launch resumed from (0: from scratch), once launched

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "step": self.step,
            "onset_step": self.onset_step,
            "value": self.value,
            "rollback_to": self.rollback_to,
            "skips": [list(r) for r in self.skips],
            "reason": self.reason,
            "resumed_from": self.resumed_from,
        }


@dataclass(frozen=True)
class Stop:
    """Stop the attempt for `reason`; with `exit`, end the job once it is stopped."""

    reason: str
    exit: Exit | None = None


@dataclass(frozen=True)
class AnomalyState:
    health: detectors.Health = detectors.Health()
    skips: Skips = ()  # in force: every rank of every later attempt is told them
    pending: Rollback | None = None  # decided, not yet launched
    rollbacks: tuple[float, ...] = ()  # when automatic rollbacks were decided, inside the window
    skipped_to: tuple[tuple[str, int], ...] = ()  # kind -> the step the last skip for it reached
    served: tuple[str, ...] = ()  # operator request ids served, newest last
    incident: Incident | None = None


def bound(an: AnomalyState) -> int | None:
    return an.pending.at_most if an.pending is not None else None


def resume_bound(ev: LaunchReady) -> int | None:
    """The bound on the ranks' load (`FTSUP_RESUME_BOUND`): a rollback's only. Any other would hold ranks that
    torchrun restarts in place (a node joining the round) to the checkpoint of the attempt's launch, behind those
    the attempt committed since (docs/design/policy.md, The resume bound)."""
    return ev.resume_step if ev.at_most is not None else None


def launched(an: AnomalyState, resume_step: int | None, resume_samples: int | None) -> AnomalyState:
    """A new attempt, resumed from `resume_step` at data position `resume_samples`: the rollback is carried out."""
    incident = an.incident
    if an.pending is not None and incident is not None:
        incident = replace(incident, resumed_from=resume_step or 0)
    return replace(
        an, health=detectors.restart(an.health, resume_step, resume_samples), pending=None, incident=incident
    )


def on_beat(
    cfg: AnomalyConfig, an: AnomalyState, ev: Heartbeat, attempt: int, now: float
) -> tuple[AnomalyState, list[Log | WriteJournal], Stop | None]:
    if not cfg.enabled:
        return an, [], None
    health, found = detectors.observe(cfg, an.health, ev)
    an = replace(an, health=health)
    logs: list[Log | WriteJournal] = []
    if any(isinstance(f, detectors.Straggler | detectors.Recovered) for f in found):
        logs.append(WriteJournal())  # `ftsup status` lists the stragglers from the journal
    for f in found:
        if isinstance(f, detectors.Straggler):
            logs.append(
                log(
                    "straggler_detected",
                    "warning",
                    attempt=attempt,
                    rank=f.rank,
                    local_rank=f.local_rank,
                    ratio=f.ratio,
                    steps=f.steps,
                    step=ev.step,
                )
            )
        elif isinstance(f, detectors.Recovered):
            logs.append(log("straggler_recovered", attempt=attempt, rank=f.rank, local_rank=f.local_rank, step=ev.step))
        elif isinstance(f, detectors.Drift):
            event = "throughput_drift_recovered" if f.back else "throughput_drift_detected"
            times = {"median_s": round(f.median_s, 4), "baseline_s": round(f.baseline_s, 4)}
            logs.append(
                log(
                    event,
                    "info" if f.back else "warning",
                    attempt=attempt,
                    ratio=f.ratio,
                    steps=f.steps,
                    step=ev.step,
                    **times,
                )
            )
    anomaly = next((f for f in found if isinstance(f, detectors.Anomaly)), None)
    if anomaly is None:
        return an, logs, None
    an, more, stop = _decide(cfg, an, anomaly, attempt, now)
    return an, [*logs, *more], stop


def _told(a: detectors.Anomaly) -> str:
    what = f"{a.kind.replace('_', ' ')} at step {a.step}"
    if a.kind == "nonfinite":
        value = "a step the rank-side guard refused" if a.figure == "step_skipped" else f"{a.figure} not finite"
        return f"{what} on rank {a.rank}: {value}"
    return f"{what} (onset step {a.onset_step}): {a.figure} {a.value:.6g} above {a.threshold:.6g}"


def _decide(
    cfg: AnomalyConfig, an: AnomalyState, a: detectors.Anomaly, attempt: int, now: float
) -> tuple[AnomalyState, list[Log], Stop | None]:
    told = _told(a)
    value = a.value if a.value is not None and math.isfinite(a.value) else None
    logs = [
        log(
            "anomaly_detected",
            "error",
            attempt=attempt,
            kind=a.kind,
            step=a.step,
            onset_step=a.onset_step,
            value=value,
            threshold=a.threshold,
            rank=a.rank,
            figure=a.figure,
            reason=told,
        )
    ]
    rollbacks = tuple(t for t in an.rollbacks if now - t < cfg.rollback_window_s)
    reached = dict(an.skipped_to).get(a.kind)
    h = an.health
    start = detectors.position_before(h, a.onset_step)
    end = detectors.position_after(h, a.step)
    g = detectors.global_batch(h)
    if end is not None and cfg.skip_extra_steps:
        end = end + cfg.skip_extra_steps * g if g is not None else None
    skip: Skips = ((start, end),) if start is not None and end is not None and end > start else ()
    skips = merge_skips(an.skips, skip)
    why = None
    if reached is not None and a.onset_step <= reached + cfg.detection_window_steps:
        why = f"{told}, again after the data skip up to step {reached} did not help"
    elif len(rollbacks) >= cfg.max_rollbacks:
        why = f"{told}; the rollback budget is spent ({len(rollbacks)} within {cfg.rollback_window_s:g}s)"
    elif len(skips) > MAX_DATA_SKIPS:
        why = f"{told}; a skip more would make {len(skips)} ranges, more than the {MAX_DATA_SKIPS} the ranks take"
    if why is not None:
        incident = Incident(a.kind, a.step, a.onset_step, value, None, (), why)
        return (
            replace(an, incident=incident, rollbacks=rollbacks),
            [*logs, log("anomaly_escalated", "error", attempt=attempt, kind=a.kind, step=a.step, reason=why)],
            Stop(why, Exit(EXIT_ANOMALY, f"anomaly escalated: {why}")),
        )
    to, before = max(0, a.onset_step - 1 - cfg.rollback_margin_steps), an.skips
    reason = f"{told}; rolling back to step {to} or before" + (
        f", skipping data positions [{skip[0][0]}, {skip[0][1]})" if skip else " (no samples figure: no data skip)"
    )
    an = replace(
        an,
        skips=skips,
        pending=Rollback(to, "auto", reason),
        rollbacks=(*rollbacks, now),
        skipped_to=tuple(sorted({**dict(an.skipped_to), a.kind: a.step + cfg.skip_extra_steps}.items())),
        incident=Incident(a.kind, a.step, a.onset_step, value, to, skip, reason),
    )
    logs.append(
        log(
            "rollback_started",
            "warning",
            attempt=attempt,
            to_step=to,
            skips=[list(r) for r in skip],
            reason=reason,
            who="supervisor",
            trigger="auto",
        )
    )
    logs += _skipped(before, an.skips, skip, attempt)
    return an, logs, Stop(reason)


def _skipped(before: Skips, after: Skips, added: Skips, attempt: int | None) -> list[Log]:
    """`data_skipped`: the skips in force, the ones added and how many positions are newly skipped."""
    if not added:
        return []
    samples = sum(b - a for a, b in after) - sum(b - a for a, b in before)
    return [
        log(
            "data_skipped",
            attempt=attempt,
            skips=[list(r) for r in after],
            added=[list(r) for r in added],
            samples=samples,
        )
    ]


def operator(an: AnomalyState, ev: RollbackRequested, attempt: int | None) -> tuple[AnomalyState, list[Log]]:
    """Serve an operator's request (once per id): the next launch resumes from a checkpoint of a step at most
    `ev.to_step`, with its skips added. The caller stops the running attempt, if any."""
    if ev.id in an.served:
        return an, []
    served = (*an.served, ev.id)[-MAX_SERVED:]
    before, skips = an.skips, merge_skips(an.skips, ev.skips)
    fields: dict[str, Any] = {"attempt": attempt, "to_step": ev.to_step, "who": ev.who, "id": ev.id}
    requested = log("rollback_requested", **fields, reason=ev.reason, skips=[list(r) for r in ev.skips])
    if len(skips) > MAX_DATA_SKIPS:
        why = f"its skips would make {len(skips)} ranges in force, more than the {MAX_DATA_SKIPS} the ranks take"
        return replace(an, served=served), [requested, log("rollback_refused", "error", **fields, reason=why)]
    reason = f"operator rollback to step {ev.to_step} by {ev.who}" + (f": {ev.reason}" if ev.reason else "")
    an = replace(
        an,
        skips=skips,
        served=served,
        pending=Rollback(ev.to_step, "operator", reason),
        incident=Incident("operator", None, None, None, ev.to_step, ev.skips, reason),
    )
    started = log(
        "rollback_started", "warning", **fields, skips=[list(r) for r in ev.skips], reason=reason, trigger="operator"
    )
    return an, [requested, started, *_skipped(before, skips, ev.skips, attempt)]
