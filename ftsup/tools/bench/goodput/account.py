"""Goodput as `ftsup bench goodput` measures it, from outside and alike for every contender: pure arithmetic.

What it reads (a `Timeline`): the first launch and the job's end (wall clock); the trainer's loss log, one line
per optimizer step with the time it was written (`Line`); and what the benchmark saw of each interruption from
outside (`Interruption`): when its fault was delivered, when the launcher reacted (a rank of the faulted attempt
other than the target gone, or the launcher itself exited), when new rank processes (or, after an eviction, a
requeued launcher) started, and how long the resumed attempt's checkpoint load took.

Every second from the first launch to the end is put in exactly one bucket, in time order, so that
productive + the badput of every cause = wall (a telescoping sum: one cursor walks the timeline and each
bucket takes the span up to its next mark):

- productive: the time of each step's first completion, a step trained twice counting once. A step's time
  is the gap since the line before it; for the first step of an attempt (no line of its own attempt before it),
  the job's median clean step time. The gap after a periodic checkpoint's step is productive up to that
  median, its excess `checkpoint_save` (the time the save blocked the loop).
- `wasted_progress`: steps trained again (their gaps), and the part of a step in flight when its fault hit.
- after a kill or a hang: `detection` (fault -> the launcher's reaction), `backoff` (-> new rank processes:
  teardown, backoff, the launcher's own restart), `startup` (-> the resumed first step, less the load and that
  step's own time) and `checkpoint_load`.
- after an eviction notice: `eviction` (notice -> the launcher gone -> the requeued one started), then
  `startup` and `checkpoint_load` as above. Steps logged after the notice, before the launcher stops (an
  emergency save's step), are training like any other.
- `startup`: first launch -> first step (less that step's time), or to the end when no step came; `other`: the
  last step -> the end (the final save and the exit), and a restart no scheduled fault explains (up to its
  new ranks).

Goodput = productive / wall. Not here: running anything (`drive`), or tables (`report`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

CAUSES = ("startup", "checkpoint_load", "checkpoint_save", "wasted_progress", "detection", "backoff", "eviction",
          "other")  # fmt: skip
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
            "productive_s": round(self.productive_s, 3), "wall_s": round(self.wall_s, 3),
            "badput_s": {k: round(v, 3) for k, v in self.badput_s.items()}, "step_s": round(self.step_s, 4),
            "steps": self.steps, "redone_steps": self.redone_steps,
        }  # fmt: skip


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
        productive_s=productive, badput_s=led.buckets, wall_s=wall, goodput=productive / wall if wall > 0 else None,
        step_s=step_s, steps=len(seen), redone_steps=redone,
    )  # fmt: skip


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
