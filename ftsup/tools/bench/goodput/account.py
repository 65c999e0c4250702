"""Goodput as `ftsup bench goodput` measures it, from outside and alike for every contender: pure arithmetic over a
`Timeline` (the loss log's lines, each timed as it appeared, and each interruption as seen from outside). A cursor
walks the timeline and puts every second in exactly one bucket, so that productive + badput = wall; which second
goes where: docs/benchmarks.md, "Goodput against torchrun and ft_launcher".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ftsup.supervisor.policy.goodput import CAUSES  # the causes ftsup_badput_seconds_total counts, for every contender

OTHER = "other"  # an Interruption's kind for a restart that no scheduled fault explains


@dataclass(frozen=True)
class Line:
    """A loss-log line: `step` completed, seen at wall time `t`."""

    t: float
    step: int


@dataclass(frozen=True)
class Interruption:
    """A fault as seen from outside: delivered at `t` (kind `kill`, `hang`, `evict`, or `other`); the launcher
    reacted at `reacted_t`; new ranks (after an eviction: the requeued launcher) started at `relaunched_t`; the
    resumed attempt's checkpoint load took `load_s`. A mark never seen is None."""

    t: float
    kind: str
    reacted_t: float | None = None
    relaunched_t: float | None = None
    load_s: float | None = None


@dataclass(frozen=True)
class Timeline:
    start: float
    end: float
    lines: tuple[Line, ...]
    interruptions: tuple[Interruption, ...] = ()
    save_every: int = 0  # the trainer's --ckpt-every; 0: no periodic saves to tell apart


@dataclass(frozen=True)
class Account:
    productive_s: float
    badput_s: dict[str, float]
    wall_s: float
    goodput: float | None
    step_s: float  # the median clean step time used for first steps and save excess
    steps: int  # distinct steps completed
    redone_steps: int  # completions of a step already completed before
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "productive_s": round(self.productive_s, 3),
            "wall_s": round(self.wall_s, 3),
            "badput_s": {k: round(v, 3) for k, v in self.badput_s.items()},
            "step_s": round(self.step_s, 4),
            "steps": self.steps,
            "redone_steps": self.redone_steps,
        }


class _Ledger:
    """A cursor over the timeline: `to(bucket, t)` gives `bucket` the span from the cursor to `t` (nothing when
    `t` is not past it) and moves the cursor there. Whatever the marks, the buckets add up to the span walked."""

    def __init__(self, start: float) -> None:
        self.at = start
        self.buckets = dict.fromkeys(("productive", *CAUSES), 0.0)

    def to(self, bucket: str, t: float) -> None:
        if t > self.at:
            self.buckets[bucket] += t - self.at
            self.at = t


def account(tl: Timeline) -> Account:
    """Put every second of `tl` in one bucket (see the module's docstring)."""
    lines = sorted((ln for ln in tl.lines if tl.start <= ln.t <= tl.end), key=lambda ln: ln.t)
    events = sorted(tl.interruptions, key=lambda e: e.t)
    starts = [_effective_start(e, lines) for e in events]
    step_s = median_step_s(lines, starts, tl.save_every)
    led = _Ledger(tl.start)
    seen: set[int] = set()
    redone = 0
    prev: Line | None = None
    for line in lines:
        lo = prev.t if prev is not None else tl.start
        inside = [(s, e) for s, e in zip(starts, events, strict=True) if lo <= s < line.t]
        new = line.step not in seen
        own_bucket = "productive" if new else "wasted_progress"
        if inside or prev is None:  # the first step of an attempt: its own time is the median
            own = min(step_s, line.t - lo)
            led.to("startup" if prev is None else "wasted_progress", inside[0][0] if inside else lo)
            for i, (_, e) in enumerate(inside):
                _recovery(led, e, inside[i + 1][0] if i + 1 < len(inside) else line.t - own)
            led.to("startup", line.t - own)
            led.to(own_bucket, line.t)
        elif new and tl.save_every > 0 and prev.step % tl.save_every == 0:
            led.to("checkpoint_save", line.t - min(step_s, line.t - prev.t))
            led.to("productive", line.t)
        else:
            led.to(own_bucket, line.t)
        redone += 0 if new else 1
        seen.add(line.step)
        prev = line
    lo = prev.t if prev is not None else tl.start
    tail = [(s, e) for s, e in zip(starts, events, strict=True) if s >= lo]
    if tail:
        led.to("wasted_progress" if prev is not None else "startup", tail[0][0])
        for i, (_, e) in enumerate(tail):
            _recovery(led, e, tail[i + 1][0] if i + 1 < len(tail) else tl.end)
    led.to(OTHER if prev is not None else "startup", tl.end)  # no step at all: it never got past its start
    wall = tl.end - tl.start
    productive = led.buckets.pop("productive")
    return Account(
        productive_s=productive,
        badput_s=led.buckets,
        wall_s=wall,
        goodput=productive / wall if wall > 0 else None,
        step_s=step_s,
        steps=len(seen),
        redone_steps=redone,
    )


def _effective_start(e: Interruption, lines: Sequence[Line]) -> float:
    """When an interruption starts costing: its delivery, or the last line logged before the launcher reacted
    when training went on after the delivery (the steps up to an emergency save after an eviction notice)."""
    stop = e.reacted_t if e.reacted_t is not None else e.t
    after = [ln.t for ln in lines if e.t < ln.t <= stop]
    return max([e.t, *after])


def _recovery(led: _Ledger, e: Interruption, until: float) -> None:
    """The span from the cursor to `until`, spent on interruption `e`, split at its marks (each clipped to it)."""
    first, second = {"evict": ("eviction", "eviction"), OTHER: (OTHER, "backoff")}.get(e.kind, ("detection", "backoff"))
    reacted = min(until, e.reacted_t) if e.reacted_t is not None else until
    led.to(first, reacted)
    relaunched = min(until, e.relaunched_t) if e.relaunched_t is not None else reacted
    led.to(second, relaunched)
    led.to("startup", until - min(e.load_s or 0.0, max(0.0, until - led.at)))
    led.to("checkpoint_load", until)


def median_step_s(lines: Sequence[Line], starts: Sequence[float], save_every: int) -> float:
    """The median gap between consecutive steps with nothing between them: no interruption, no periodic save
    (0 when there are none; then the median of every consecutive step's gap, if any)."""
    clean, consecutive = [], []
    for a, b in zip(lines, lines[1:], strict=False):
        if b.step != a.step + 1:
            continue
        consecutive.append(b.t - a.t)
        interrupted = any(a.t <= s < b.t for s in starts)
        if not interrupted and not (save_every > 0 and a.step % save_every == 0):
            clean.append(b.t - a.t)
    got = clean or consecutive
    return statistics.median(got) if got else 0.0
