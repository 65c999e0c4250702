"""How far ahead a rank's step can be: a beat claiming more is not believed (the rule: docs/design/run-loop.md, The
heartbeat channel). Pure: the loop's clock comes in as `now`."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STEPS_PER_S = 100_000.0
"""The fastest a rank's step count can grow: a step of 10 us, shorter than any optimizer step in any framework."""
BANK_S = 60.0
"""How long a rank's unused allowance is saved up: a loop that read no beat for a while, or beats queued behind a
busy loop, then show a rank a minute of steps ahead at that rate."""
MAX_ALLOWANCE = MAX_STEPS_PER_S * BANK_S


@dataclass(frozen=True)
class Pace:
    """One rank of one attempt: the highest step believed, and how many steps beyond it it may claim as of `at`."""

    high: int
    allowance: float
    at: float
    believed: bool = False  # a beat of this rank was believed: from then on the allowance is capped


def start(step: int, now: float) -> Pace:
    """A rank of an attempt launched at `now` from `step` (its resume step; 0 for a fresh start)."""
    return Pace(step, MAX_ALLOWANCE, now)


def advance(pace: Pace, step: int, now: float) -> Pace | None:
    """`pace` after a beat claiming `step` read at `now`, or None when `step` is further ahead than a step can be.

    A step up to the highest believed is always believed (a worker group restarted from a checkpoint). Beyond it, a
    beat may claim as many steps as its allowance: it grows by MAX_STEPS_PER_S a second and is spent by the steps
    believed, saved up to MAX_ALLOWANCE once a beat of the rank was believed. Before that, from the attempt's launch
    and resume step, it is not capped: a script that counts its steps from a checkpoint of its own starts ahead."""
    allowance = pace.allowance + MAX_STEPS_PER_S * max(0.0, now - pace.at)
    if pace.believed:
        allowance = min(allowance, MAX_ALLOWANCE)
    ahead = step - pace.high
    if ahead > allowance:
        return None
    return Pace(max(pace.high, step), min(allowance - max(0, ahead), MAX_ALLOWANCE), now, believed=True)
