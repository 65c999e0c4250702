"""The seeded fault schedule of `ftsup bench goodput`: which fault, on which rank, how long into the run.

Faults arrive as a Poisson process in wall time, each of a kind drawn from `mix` by weight and aimed at a rank drawn
uniformly; every fault draws the same three numbers from one `random.Random(seed)`, so that a longer horizon only
appends. Pure: no clock, no processes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

KINDS = ("kill", "hang", "evict")
DEFAULT_MIX = "kill=1,hang=1,evict=1"
DEFAULT_MEAN_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: the `index`-th, due `at_s` seconds into the run (goodput: after the job's first step)."""

    index: int
    at_s: float
    kind: str
    rank: int


def parse_mix(text: str) -> dict[str, float]:
    """`kill=2,hang=1,evict=1` (a kind alone weighs 1) as {kind: weight}; ValueError naming what is wrong.
    Kinds not named weigh 0; at least one must weigh more."""
    mix = dict.fromkeys(KINDS, 0.0)
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        kind, sep, weight = part.partition("=")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r} in {text!r} is not one of {', '.join(KINDS)}")
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"weight {weight!r} of {kind} in {text!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"weight of {kind} in {text!r} must be a finite number >= 0, got {weight}")
        mix[kind] = value
    if not any(w > 0 for w in mix.values()):
        raise ValueError(f"fault mix {text!r} gives no kind a weight above 0")
    return mix


def plan(
    seed: int, mean_interval_s: float, mix: Mapping[str, float], *, nproc: int, horizon_s: float
) -> tuple[Fault, ...]:
    """Every fault due within `horizon_s` seconds of the first launch, in order."""
    if not (math.isfinite(mean_interval_s) and mean_interval_s > 0):
        raise ValueError(f"the mean interval between faults must be > 0 s, got {mean_interval_s}")
    if nproc < 1:
        raise ValueError(f"faults need at least one rank to aim at, got nproc {nproc}")
    kinds = [k for k in KINDS if mix.get(k, 0) > 0]
    weights = [mix[k] for k in kinds]
    if not kinds:
        raise ValueError("no fault kind has a weight above 0")
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_interval_s)
        kind = rng.choices(kinds, weights)[0]
        rank = rng.randrange(nproc)
        if t > horizon_s:
            return tuple(faults)
        faults.append(Fault(len(faults), round(t, 3), kind, rank))
