"""How far ahead a rank's step can be (`policy.pace`), on a fake clock: what a beat may claim, and what it may not."""

from __future__ import annotations

from ftsup.supervisor.policy import pace
from ftsup.supervisor.policy.pace import MAX_ALLOWANCE, MAX_STEPS_PER_S


def believed(steps_at: list[tuple[int, float]], base: int = 0) -> list[bool]:
    """For beats (step, time) of one rank of an attempt launched at 0 from `base`: whether each is believed."""
    p = pace.start(base, 0.0)
    out = []
    for step, now in steps_at:
        nxt = pace.advance(p, step, now)
        out.append(nxt is not None)
        p = nxt or p
    return out


def test_a_beat_claiming_step_ten_to_the_twelve_is_not_believed():
    assert believed([(1, 1.0), (2, 1.1), (10**12, 1.2), (3, 1.3)]) == [True, True, False, True]


def test_a_rank_stepping_at_any_real_pace_is_always_believed():
    fast = [(i, 0.5 + i / 10_000) for i in range(1, 20_001)]  # ten thousand steps a second, for two seconds
    assert all(believed(fast))


def test_a_rank_resuming_from_a_checkpoint_starts_from_its_step():
    assert believed([(10**6 + 1, 5.0)], base=10**6) == [True]


def test_a_first_beat_far_ahead_of_the_resume_step_is_believed_once_the_rate_allows_it():
    step = int(MAX_ALLOWANCE + MAX_STEPS_PER_S * 10)  # a script counting its steps from a checkpoint of its own
    assert believed([(step, 5.0), (step, 9.0), (step, 10.5)]) == [False, False, True]


def test_a_step_back_is_always_believed_and_lowers_nothing():
    p = pace.start(0, 0.0)
    p = pace.advance(p, 100, 1.0) or p
    back = pace.advance(p, 40, 1.0)  # a worker group restarted from a checkpoint
    assert (back is not None and back.high) == 100


def test_many_small_leaps_cannot_add_up_past_the_rate():
    """A forger sending beat after beat, each a little ahead, climbs no faster than the allowance lets it."""
    p = pace.start(0, 0.0)
    p = pace.advance(p, 1, 1.0) or p  # believed: from here the allowance is capped
    climbed = p.high
    for i in range(10_000):
        nxt = pace.advance(p, climbed + 100_000, 1.0 + i * 1e-4)
        if nxt is not None:
            p, climbed = nxt, nxt.high
    assert climbed <= 1 + MAX_ALLOWANCE + MAX_STEPS_PER_S * 1.0


def test_a_rank_seen_late_after_a_busy_loop_is_believed_again():
    p = pace.start(0, 0.0)
    p = pace.advance(p, 10, 1.0) or p
    late = pace.advance(p, 10 + 300_000, 31.0)  # thirty seconds at ten thousand steps a second, read at once
    assert late is not None
