"""Training-health detectors over the heartbeat stream: pure functions of frozen values, no I/O and no clock.

`observe` folds one heartbeat's figures into a `Health`, `restart` starts an attempt's view; what each detector
looks for: docs/design/policy.md, The detectors.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from ftsup.supervisor.config.anomaly import AnomalyConfig
from ftsup.supervisor.policy.events import Heartbeat

KINDS = ("nonfinite", "loss_spike", "grad_norm_spike")
SETTLE_STEPS = 2  # an attempt's first steps warm caches and allocators on every rank alike: not timed
POSITIONS = 512  # data positions kept, newest last: more than a spike's patience reaches back in practice
PENDING = 8  # steps a step waits for its last rank at most (a beat lost); then it is judged as it is
MIN_REFERENCE = 5  # values a trailing median needs before it judges anything
RATIO_STEPS = 20  # step times per rank behind `step_time_ratios`
SLOW_QUANTILE = 0.2  # a straggler is slow on nearly every step: its 20th-percentile step, not its median


@dataclass(frozen=True)
class Anomaly:
    kind: str  # one of KINDS
    step: int  # the step it was detected on
    onset_step: int
    value: float | None  # None: not finite
    threshold: float | None
    rank: int  # global rank: the one that reported it, or the highest value's
    figure: str  # loss, grad_norm or step_skipped


@dataclass(frozen=True)
class Straggler:
    rank: int
    local_rank: int
    ratio: float  # its step time over the other ranks' median, on the last slow step
    steps: int  # slow steps in a row


@dataclass(frozen=True)
class Recovered:
    rank: int
    local_rank: int


@dataclass(frozen=True)
class Drift:
    ratio: float
    median_s: float
    baseline_s: float
    steps: int
    back: bool = False  # fell back under the ratio


Finding = Anomaly | Straggler | Recovered | Drift


@dataclass(frozen=True)
class Figures:
    """One rank's figures of one step (None: not reported)."""

    rank: int
    loss: float | None = None
    grad_norm: float | None = None
    step_s: float | None = None
    compute_s: float | None = None  # its own work, without waiting for its peers


@dataclass(frozen=True)
class Spike:
    """One spike detector: the trailing window of values judged normal, and the current run of high ones."""

    normal: tuple[tuple[int, float], ...] = ()  # (step, value), oldest first
    run: tuple[tuple[int, float, int], ...] = ()  # (step, value, rank)


@dataclass(frozen=True)
class RankTimes:
    rank: int  # global
    times: tuple[float, ...] = ()  # its last step times (own work), at least RATIO_STEPS
    reported: bool = False  # a straggler now


@dataclass(frozen=True)
class Health:
    first_step: int = 1  # this attempt's first step
    judged: int = 0  # every step up to this one is judged
    latest: tuple[tuple[int, int], ...] = ()  # local rank -> the newest step it reported
    pending: tuple[tuple[int, tuple[tuple[int, Figures], ...]], ...] = ()  # step -> local rank -> figures
    positions: tuple[tuple[int, int], ...] = ()  # (step, the data position after it), newest last
    loss: Spike = Spike()
    grad: Spike = Spike()
    ranks: tuple[tuple[int, RankTimes], ...] = ()  # local rank -> its step times
    job_times: tuple[float, ...] = ()  # the job's step times, first the baseline window, then the trailing one
    baseline_s: float | None = None
    drifting: bool = False

    @property
    def stragglers(self) -> tuple[int, ...]:
        """The global ranks reported as stragglers now."""
        return tuple(sorted(t.rank for _, t in self.ranks if t.reported))


def restart(h: Health, resume_step: int | None, resume_samples: int | None) -> Health:
    """The view of an attempt resumed from `resume_step` (None: from scratch), at data position `resume_samples`:
    what the steps after it said is forgotten (they will be trained again, or were of a timeline rolled back)."""
    r = resume_step or 0
    known = {s: p for s, p in h.positions if s <= r}
    if resume_samples is not None:
        known[r] = resume_samples
    positions = tuple(sorted(known.items()))

    def kept(s: Spike) -> Spike:
        return Spike(tuple(v for v in s.normal if v[0] <= r))

    return Health(first_step=r + 1, judged=r, positions=positions[-POSITIONS:], loss=kept(h.loss), grad=kept(h.grad))


def position_before(h: Health, step: int) -> int | None:
    """The data position before `step`: the one after step - 1, else the one after `step` less a global batch."""
    known = dict(h.positions)
    if step - 1 in known:
        return known[step - 1]
    g = global_batch(h)
    return known[step] - g if step in known and g is not None else None


def position_after(h: Health, step: int) -> int | None:
    return dict(h.positions).get(step)


def global_batch(h: Health) -> int | None:
    """The global batch, from two consecutive `samples` figures (the smallest difference: a skip between two
    steps makes theirs larger)."""
    pairs = zip(h.positions, h.positions[1:], strict=False)
    diffs = [b[1] - a[1] for a, b in pairs if b[0] == a[0] + 1 and b[1] > a[1]]
    return min(diffs) if diffs else None


def step_time_ratios(h: Health) -> dict[int, float]:
    """Each global rank's median step time over the median of every rank's (recent steps; 2 ranks or more)."""
    medians = {t.rank: statistics.median(t.times) for _, t in h.ranks if t.times}
    if len(medians) < 2:
        return {}
    mid = statistics.median(medians.values())
    return {rank: m / mid for rank, m in medians.items()} if mid > 0 else {}


# ---------------------------------------------------------------------- folding beats in


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def observe(cfg: AnomalyConfig, h: Health, beat: Heartbeat) -> tuple[Health, list[Finding]]:
    """Fold in one training-step heartbeat of this attempt; (the new view, what it found)."""
    fig = dict(beat.figures)
    found: list[Finding] = []
    if not cfg.enabled:
        return h, found
    if cfg.nonfinite and (bad := _nonfinite(fig)) is not None:
        value = _finite(fig.get(bad)) if bad == "step_skipped" else None
        found.append(Anomaly("nonfinite", beat.step, beat.step, value, None, beat.rank, bad))
    samples = fig.get("samples")
    if samples is not None and math.isfinite(samples) and samples >= 0 and beat.step not in dict(h.positions):
        positions = sorted({*h.positions, (beat.step, int(samples))})
        h = replace(h, positions=tuple(positions[-POSITIONS:]))
    latest = dict(h.latest)
    latest[beat.local_rank] = max(latest.get(beat.local_rank, 0), beat.step)
    h = replace(h, latest=tuple(sorted(latest.items())))
    if beat.step <= h.judged:
        return h, found  # late or a duplicate: judged already
    pending = {s: dict(by) for s, by in h.pending}
    by_rank = pending.setdefault(beat.step, {})
    if beat.local_rank not in by_rank:  # the first beat of a step counts; a save's beat repeats the step
        by_rank[beat.local_rank] = Figures(
            beat.rank, fig.get("loss"), fig.get("grad_norm"), fig.get("step_s"), fig.get("compute_s")
        )
    done = min(latest.values())
    # Ranks are read one queue after the other, so one may be several steps ahead of another within a read.
    done = max(done, max(latest.values()) - PENDING)
    for step in sorted(s for s in pending if s <= done):
        h, more = _judge(cfg, h, step, pending.pop(step))
        found += more
    if done > h.judged:
        h = replace(h, judged=done)
    return replace(h, pending=tuple((s, tuple(sorted(by.items()))) for s, by in sorted(pending.items()))), found


def _nonfinite(fig: dict[str, float]) -> str | None:
    for name in ("loss", "grad_norm"):
        if name in fig and not math.isfinite(fig[name]):
            return name
    skipped = fig.get("step_skipped")
    return "step_skipped" if skipped is not None and (not math.isfinite(skipped) or skipped > 0) else None


def _judge(cfg: AnomalyConfig, h: Health, step: int, by_rank: dict[int, Figures]) -> tuple[Health, list[Finding]]:
    found: list[Finding] = []
    ranks = [f for _, f in sorted(by_rank.items())]
    losses = [(v, f.rank) for f in ranks if (v := _finite(f.loss)) is not None]
    if losses:
        mean = math.fsum(v for v, _ in losses) / len(losses)
        top = max(losses, key=lambda p: p[0])[1]  # the first rank of the highest value
        loss, a = _spike(cfg, h.loss, step, mean, top, cfg.loss_spike_factor, "loss_spike", "loss")
        h = replace(h, loss=loss)
        found += a
    norms = [(v, f.rank) for f in ranks if (v := _finite(f.grad_norm)) is not None]
    if norms:
        value, rank = max(norms, key=lambda p: p[0])
        grad, a = _spike(cfg, h.grad, step, value, rank, cfg.grad_norm_spike_factor, "grad_norm_spike", "grad_norm")
        h = replace(h, grad=grad)
        found += a
    times = {r: t for r, f in by_rank.items() if (t := _finite(f.step_s)) is not None and t >= 0}
    own = {r: t for r, f in by_rank.items() if (t := _finite(f.compute_s)) is not None and t >= 0}
    if times and step >= h.first_step + SETTLE_STEPS:
        h, more = _time(
            cfg, h, step, own if len(own) == len(by_rank) else times, times, {r: f.rank for r, f in by_rank.items()}
        )
        found += more
    return h, found


def _spike(
    cfg: AnomalyConfig, s: Spike, step: int, value: float, rank: int, factor: float, kind: str, figure: str
) -> tuple[Spike, list[Anomaly]]:
    window = cfg.loss_window_steps
    reference = [v for _, v in s.normal[-window:]]
    if step <= cfg.warmup_steps or len(reference) < min(MIN_REFERENCE, window):
        return Spike((*s.normal, (step, value))[-window:]), []
    threshold = factor * statistics.median(reference)
    if value <= threshold:
        return Spike((*s.normal, (step, value))[-window:]), []  # a run too short to confirm is dropped
    run = (*s.run, (step, value, rank))[: cfg.loss_patience_steps]  # a spike is told once, however long
    if len(run) > len(s.run) == cfg.loss_patience_steps - 1:
        return replace(s, run=run), [Anomaly(kind, step, run[0][0], value, threshold, rank, figure)]
    return replace(s, run=run), []


def _time(
    cfg: AnomalyConfig,
    h: Health,
    step: int,
    own: dict[int, float],
    times: dict[int, float],
    global_rank: dict[int, int],
) -> tuple[Health, list[Finding]]:
    """Stragglers from each rank's own work (`own`), drift from the job's step times (`times`). A rank is slow when
    nearly every one of its last `straggler_patience_steps` times is above `straggler_ratio` x the median of the
    other ranks' medians: its low quantile (`SLOW_QUANTILE`), not its median, is compared, so that a rank the
    host's scheduler kept waiting on some of its steps (a burst of other work on its core: real, but not a
    rank that is slow) is not reported, while one quick step of a slow rank changes nothing. It is no longer
    slow once its median falls back under halfway."""
    found: list[Finding] = []
    p = cfg.straggler_patience_steps
    ranks = dict(h.ranks)
    for local, t in own.items():
        prev = ranks.get(local) or RankTimes(global_rank[local])
        ranks[local] = replace(prev, times=(*prev.times, t)[-max(RATIO_STEPS, p) :])
    medians = {r: statistics.median(v.times[-p:]) for r, v in ranks.items() if len(v.times) >= p}
    for local in sorted(own):
        prev = ranks[local]
        others = [m for r, m in medians.items() if r != local]
        if local not in medians or not others or statistics.median(others) <= 0:
            continue  # not enough to compare with yet
        recent = sorted(prev.times[-p:])
        low = recent[int(len(recent) * SLOW_QUANTILE)] / statistics.median(others)
        ratio = medians[local] / statistics.median(others)
        if not prev.reported and low > cfg.straggler_ratio:
            ranks[local] = replace(prev, reported=True)
            found.append(Straggler(prev.rank, local, round(low, 3), p))
        elif prev.reported and ratio <= (1 + cfg.straggler_ratio) / 2:
            ranks[local] = replace(prev, reported=False)
            found.append(Recovered(prev.rank, local))
    h = replace(h, ranks=tuple(sorted(ranks.items())))
    window = cfg.loss_window_steps
    job = (*h.job_times, statistics.median(times.values()))
    base = h.baseline_s
    if base is None:
        if len(job) < window:
            return replace(h, job_times=job), found
        return replace(h, job_times=(), baseline_s=statistics.median(job)), found
    job = job[-window:]
    h = replace(h, job_times=job)
    if len(job) < window or base <= 0:
        return h, found
    now = statistics.median(job)
    # Back only halfway down to the baseline: a step time that hovers at the ratio is one drift, not many.
    drifting = now > cfg.drift_ratio * base if not h.drifting else now > (1 + cfg.drift_ratio) / 2 * base
    if drifting != h.drifting:
        found.append(Drift(round(now / base, 3), now, base, window, back=not drifting))
    return replace(h, drifting=drifting), found
