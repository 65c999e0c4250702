"""`heartbeat.mode`: which detections the policy applies (off, auto, required), driven by a fake clock.

Crashes are detected in every mode; hangs, stalls and a slow start only in `required`, or in `auto` once the job
has sent a heartbeat. An attempt that sent no training step while no hang detection applied counts as progress
for the crash-loop breaker when it ran past `startup_timeout_s`.
"""

from __future__ import annotations

import math

from ftsup.protocol import Phase
from ftsup.supervisor.config.job import HeartbeatMode
from ftsup.supervisor.policy import machine as P
from tests.settings import settings

STARTUP_S = 60.0


def mode(name: str, **overrides: object) -> P.Settings:
    return settings(
        nproc_max=2,
        heartbeat_mode=HeartbeatMode(name),
        startup_timeout_s=STARTUP_S,
        backoff_initial_s=1,
        backoff_max_s=1,
        max_attempts_without_progress=3,
        **overrides,
    )


class Driver:
    def __init__(self, s: P.Settings):
        self.m = P.Machine(s)
        self.now = 0.0
        self.actions: list[P.Action] = []

    def feed(self, ev: P.Event) -> list[P.Action]:
        self.m, acts = self.m.feed(ev, self.now)
        self.actions += acts
        return acts

    def launch(self) -> int:
        self.feed(P.Start() if self.m.state.phase == "init" else P.Tick())
        (launch,) = [a for a in self.feed(P.LaunchReady(2, None)) if isinstance(a, P.Launch)]
        self.feed(P.WorkersStarted(launch.attempt))
        return launch.attempt

    def tick_until(self, t: float) -> None:
        while self.now < t:
            self.now = min(t, self.now + 1.0)
            self.feed(P.Tick())

    def train(self, attempt: int, steps: range, dt: float = 0.5) -> None:
        for step in steps:
            self.now += dt
            for rank in range(2):
                self.feed(P.Heartbeat(attempt, rank, step, Phase.TRAIN, sent=self.now))

    def events(self) -> list[str]:
        return [a.event for a in self.actions if isinstance(a, P.Log)]

    def exit_code(self) -> int | None:
        return next((a.code for a in self.actions if isinstance(a, P.Exit)), None)


HANG_EVENTS = {"startup_timed_out", "heartbeat_timed_out", "progress_timed_out"}


def test_by_default_a_job_that_never_beats_is_not_failed_at_the_startup_timeout():
    d = Driver(settings(nproc_max=2, startup_timeout_s=STARTUP_S))
    d.launch()
    d.tick_until(10 * STARTUP_S)
    assert (HANG_EVENTS & set(d.events()), d.m.state.phase) == (set(), "running")


def test_in_auto_mode_a_rank_silent_after_the_first_heartbeats_is_a_hang():
    d = Driver(mode("auto"))
    attempt = d.launch()
    d.train(attempt, range(1, 11))  # learned timeout: max(2, 3 x 0.5) = 2 s
    d.tick_until(d.now + 5)
    assert "heartbeat_timed_out" in d.events()


def test_in_auto_mode_an_attempt_after_the_job_has_beaten_gets_the_startup_timeout():
    d = Driver(mode("auto"))
    attempt = d.launch()
    d.train(attempt, range(1, 4))
    d.feed(P.WorkersExited(attempt, 1))
    d.tick_until(d.now + 2)  # the backoff
    d.launch()  # this attempt never beats
    d.tick_until(d.now + STARTUP_S + 2)
    assert "startup_timed_out" in d.events()


def test_in_required_mode_a_job_that_never_beats_fails_at_the_startup_timeout():
    d = Driver(mode("required"))
    d.launch()
    d.tick_until(STARTUP_S + 2)
    assert "startup_timed_out" in d.events()


def test_in_off_mode_a_rank_that_beats_and_then_falls_silent_is_never_failed():
    d = Driver(mode("off"))
    attempt = d.launch()
    d.train(attempt, range(1, 11))
    d.tick_until(d.now + 10 * STARTUP_S)
    assert (HANG_EVENTS & set(d.events()), d.m.state.phase) == (set(), "running")


def test_in_off_mode_a_crash_is_still_a_failure_and_relaunched():
    d = Driver(mode("off"))
    attempt = d.launch()
    d.now += 5
    d.feed(P.WorkersExited(attempt, -9))
    d.tick_until(d.now + 2)
    assert ("worker_exited" in d.events(), d.m.state.attempt_no, d.m.state.phase) == (True, 2, "preparing")


def test_attempts_without_heartbeats_that_die_starting_up_are_a_crash_loop():
    d = Driver(mode("auto"))
    for _ in range(3):
        attempt = d.launch()
        d.now += 3  # an import error: far within the startup timeout
        d.feed(P.WorkersExited(attempt, 1))
        d.tick_until(d.now + 2)
    assert (d.exit_code(), "crash_loop_detected" in d.events()) == (P.EXIT_CRASH_LOOP, True)


def test_attempts_without_heartbeats_that_ran_past_the_startup_timeout_count_as_progress():
    d = Driver(mode("auto", max_restarts=100))
    for _ in range(5):
        attempt = d.launch()
        d.tick_until(d.now + STARTUP_S + 1)  # trained for a while, then crashed
        d.feed(P.WorkersExited(attempt, -9))
        d.tick_until(d.now + 2)
    assert (d.exit_code(), d.m.state.no_progress_streak, d.m.state.attempt_no) == (None, 0, 6)


def test_in_off_mode_the_heartbeat_timeout_metric_shows_none_in_force():
    from ftsup.supervisor.telemetry.metrics import Metrics

    d, metrics = Driver(mode("off")), Metrics("job-1", "node-a", started_unix=0.0)
    attempt = d.launch()
    d.train(attempt, range(1, 11))
    metrics.state(d.m.state, d.m.settings, d.now, d.now)
    assert math.isnan(metrics.registry.get_sample_value("ftsup_heartbeat_timeout_seconds") or 0.0)


def beat_rank_0_alone(d: Driver, attempt: int) -> None:
    """Rank 0 trains 10 steps of 0.5 s (learned timeout 2 s), then beats within a long step 11 for 3 s (under the
    progress timeout, 4 s); rank 1 never beats."""
    for step in [*range(1, 12), *[11] * 6]:
        d.now += 0.5
        d.feed(P.Heartbeat(attempt, 0, step, Phase.TRAIN, sent=d.now))
        d.feed(P.Tick())


def test_in_auto_mode_a_rank_that_never_beats_while_rank_0_does_is_not_a_hang():
    d = Driver(mode("auto"))
    beat_rank_0_alone(d, d.launch())
    assert HANG_EVENTS & set(d.events()) == set()


def test_in_required_mode_a_rank_that_never_beats_is_a_hang():
    d = Driver(mode("required"))
    beat_rank_0_alone(d, d.launch())
    assert "heartbeat_timed_out" in d.events()
