"""The supervisor's state machine, driven by a fake clock: no processes, no sleeps."""

from __future__ import annotations

import pytest

from ftsup.protocol import Phase
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.telemetry.logs import EVENTS
from tests.settings import settings

S = settings(
    nproc_max=2,
    startup_timeout_s=60,
    save_timeout_s=100,
    min_timeout_s=2.0,
    backoff_initial_s=1,
    backoff_max_s=8,
    max_restarts=5,
    window_s=1000,
    max_attempts_without_progress=3,
)


class Driver:
    """Feeds events at explicit times and remembers every action."""

    def __init__(self, settings: P.Settings = S):
        self.m = P.Machine(settings)
        self.now = 0.0
        self.actions: list[P.Action] = []

    def feed(self, ev: P.Event, at: float | None = None) -> list[P.Action]:
        if at is not None:
            self.now = at
        self.m, acts = self.m.feed(ev, self.now)
        self.actions += acts
        return acts

    @property
    def st(self) -> P.State:
        return self.m.state

    def launch(self, healthy: int | None = 2, resume: int | None = None, divisor: int | None = None) -> P.Launch:
        acts = self.feed(P.Start()) if self.st.phase == "init" else self.feed(P.Tick())
        assert any(isinstance(a, P.PrepareLaunch) for a in acts), acts
        acts = self.feed(P.LaunchReady(healthy, resume, divisor))
        (launch,) = [a for a in acts if isinstance(a, P.Launch)]
        self.feed(P.WorkersStarted(launch.attempt))
        return launch

    def train(self, steps: range, dt: float = 0.5, ranks: int = 2) -> None:
        att = self.st.attempt
        assert att is not None and len(steps) > 0, "a train() that feeds no step tests nothing"
        for s in steps:
            self.now += dt
            for r in range(ranks):
                self.feed(P.Heartbeat(att.number, r, s, Phase.TRAIN, sent=self.now))

    def beat_all(self, step: int, phase: str, sent: float | None = None, ranks: int = 2) -> None:
        att = self.st.attempt
        assert att is not None
        for r in range(ranks):
            self.feed(P.Heartbeat(att.number, r, step, Phase(phase), sent=sent))

    def hb(self) -> float | None:
        return P.heartbeat_timeout(self.m.settings, self.st.step_times)

    def events(self) -> list[str]:
        return [a.event for a in self.actions if isinstance(a, P.Log)]


def test_a_clean_exit_ends_the_job_with_code_0():
    d = Driver()
    d.launch()
    d.train(range(1, 5))
    acts = d.feed(P.WorkersExited(1, 0))
    assert P.Exit(P.EXIT_OK, "training command exited 0") in acts
    assert d.st.phase == "done"


def test_a_rank_silent_past_the_learned_timeout_is_a_hang():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)  # p99 step time 0.5 s -> timeout max(2, 1.5) = 2 s
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN), at=d.now + 0.5)
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN), at=d.now + 1.4)
    assert d.feed(P.Tick()) == []  # rank 1 silent for 1.9 s
    d.feed(P.Heartbeat(1, 0, 11, Phase.TRAIN), at=d.now + 0.7)
    acts = d.feed(P.Tick())  # rank 1 now silent for 2.6 s, rank 0 alive
    assert P.StopWorkers(1, "rank 1 silent for 2.6s (timeout 2.0s)") in acts
    assert d.st.phase == "stopping"


def test_a_beat_claiming_a_local_rank_outside_the_attempt_is_never_waited_for():
    d = Driver()
    d.launch()  # two local ranks
    d.train(range(1, 11), dt=0.5)
    d.feed(P.Heartbeat(1, 5, 11, Phase.TRAIN, rank=5), at=d.now + 0.1)
    d.train(range(11, 21), dt=0.5)  # rank 5 silent for 5 s, far past the learned 2 s
    assert (d.feed(P.Tick()), d.st.phase, [r for r, _ in d.st.attempt.ranks]) == ([], "running", [0, 1])


def test_the_learned_timeout_is_the_multiplier_times_the_p99_step_time():
    assert P.heartbeat_timeout(S, [4.0] * 50) == 12.0


def test_the_learned_timeout_is_never_below_min_timeout_s():
    assert P.heartbeat_timeout(S, [0.1] * 50) == 2.0


def test_there_is_no_learned_timeout_before_a_step_was_seen():
    assert P.heartbeat_timeout(S, []) is None


def test_a_configured_timeout_overrides_the_learned_one():
    s = settings(nproc_max=2, heartbeat_timeout_s=30.0)
    assert P.heartbeat_timeout(s, [4.0] * 50) == 30.0


def test_a_save_much_longer_than_a_step_is_not_a_hang():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)
    d.beat_all(10, "save")
    assert (d.feed(P.Tick(), at=d.now + 90), d.st.phase) == ([], "running")  # a save 180 steps long


def test_a_rank_silent_in_a_save_past_save_timeout_s_is_a_hang():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)
    d.beat_all(10, "save")
    acts = d.feed(P.Tick(), at=d.now + 101)  # past save_timeout_s=100
    assert P.StopWorkers(1, "rank 0 silent for 101.0s in phase save (timeout 100.0s); rank 1 waiting") in acts


def test_coming_back_from_a_long_save_starts_the_progress_clock_again():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)  # progress timeout: 2 x 2 s
    d.beat_all(10, "save")
    d.now += 90
    d.beat_all(10, "train")  # the save is over; the next step is under way
    assert d.feed(P.Tick(), at=d.now + 1.5) == []


def test_no_first_step_within_the_startup_timeout_fails_the_attempt():
    d = Driver()
    d.launch()
    d.feed(P.Heartbeat(1, 0, 0, Phase.INIT))
    assert d.feed(P.Tick(), at=59) == []
    acts = d.feed(P.Tick(), at=61)
    assert "startup_timed_out" in [a.event for a in acts if isinstance(a, P.Log)]


def test_a_long_load_is_not_a_startup_timeout():
    d = Driver()
    d.launch()
    d.feed(P.Heartbeat(1, 0, 0, Phase.LOAD))
    assert d.feed(P.Tick(), at=90) == []


def test_heartbeats_without_step_progress_time_out():
    d = Driver(settings(nproc_max=2, progress_timeout_s=10.0, heartbeat_timeout_s=100.0))
    d.launch()
    d.train(range(1, 3))  # step 2 at t=1.0
    for _ in range(10):
        d.now += 1
        d.beat_all(2, "train")
        d.feed(P.Tick())
    assert "progress_timed_out" not in d.events()  # 10 s without a step: not yet past the timeout
    d.beat_all(2, "train")
    d.feed(P.Tick(), at=d.now + 0.5)
    assert "progress_timed_out" in d.events()


def test_ranks_torchrun_restarted_in_place_make_progress_on_the_steps_they_train_again():
    # A node joined: torchrun restarted the ranks in place, and they resume from a checkpoint behind step 6.
    d = Driver(settings(nproc_max=2, progress_timeout_s=10.0, heartbeat_timeout_s=100.0))
    d.launch()
    d.train(range(1, 41))
    d.feed(P.WorkersRestarted(1, new_ranks=True), at=d.now + 1)
    d.beat_all(0, "init")
    d.feed(P.Tick(), at=d.now + 8)  # their start-up: no training rank yet, so no stall
    for step in range(3, 46):  # steps 3-40 again (19 s at 0.5 s a step), then new ones: each one progress
        d.train(range(step, step + 1))
        d.feed(P.Tick())
    assert ("progress_timed_out" in d.events(), d.st.attempt and d.st.attempt.max_step) == (False, 45)


def test_a_failure_after_progress_restarts_at_once_from_the_latest_checkpoint():
    d = Driver()
    d.launch()
    d.train(range(1, 5))
    d.feed(P.WorkersExited(1, 1))
    assert (d.st.phase, d.st.resume_at - d.now) == ("backoff", 0.0)
    launch = d.launch(resume=4)
    assert (launch.attempt, launch.resume_step, launch.nproc) == (2, 4, 2)


def test_a_failure_without_progress_restarts_after_exponential_backoff():
    d = Driver()
    d.launch()
    d.train(range(1, 5))
    d.feed(P.WorkersExited(1, 1))
    d.launch(resume=4)
    d.feed(P.WorkersExited(2, 1))  # no new step: the second failure in a row
    assert (d.st.phase, d.st.resume_at - d.now) == ("backoff", 1.0)
    assert d.feed(P.Tick(), at=d.now + 0.5) == []
    d.now = d.st.resume_at
    assert d.launch(resume=4).attempt == 3


def test_backoff_doubles_up_to_the_maximum_from_the_second_failure_in_a_row():
    assert [P.backoff_s(S, n) for n in range(1, 8)] == [0, 1, 2, 4, 8, 8, 8]


def test_attempts_that_beat_but_never_pass_their_resume_step_trip_the_crash_loop_breaker():
    d = Driver()
    d.launch()
    d.train(range(1, 5))
    for _ in range(4):
        d.feed(P.WorkersExited(d.st.attempt.number, 1))
        if d.st.phase == "done":
            break
        d.feed(P.Tick(), at=d.st.resume_at)
        d.feed(P.LaunchReady(2, 4))
        d.feed(P.WorkersStarted(d.st.attempt.number))
        d.beat_all(4, "load")
        d.beat_all(4, "train")  # resumed at step 4, dies before finishing step 5 every time
    exits = [(a.code, d.st.attempt_no) for a in d.actions if isinstance(a, P.Exit)]
    assert exits == [(P.EXIT_CRASH_LOOP, 4)]  # the first attempt progressed; three more did not


def test_the_restart_budget_is_counted_in_a_window():
    d = Driver(settings(nproc_max=1, max_restarts=2, window_s=100, backoff_initial_s=0))
    for i in range(3):
        d.launch(healthy=1)
        d.train(range(10 * i + 1, 10 * i + 3), ranks=1)
        d.feed(P.WorkersExited(d.st.attempt.number, 1))
    assert [a.code for a in d.actions if isinstance(a, P.Exit)] == [P.EXIT_BUDGET]


def test_restarts_outside_the_window_do_not_count():
    d = Driver(settings(nproc_max=1, max_restarts=2, window_s=100, backoff_initial_s=0))
    for i in range(4):
        d.launch(healthy=1)
        d.train(range(10 * i + 1, 10 * i + 3), ranks=1, dt=30)
        d.feed(P.WorkersExited(d.st.attempt.number, 1))
    assert [a for a in d.actions if isinstance(a, P.Exit)] == []


@pytest.mark.parametrize(
    ("healthy", "divisor", "expected"),
    [(2, None, 2), (1, None, 1), (8, None, 4), (3, 6, 3), (4, 6, 3), (5, 12, 4), (2, 5, 1)],
)
def test_world_size_is_healthy_slots_clamped_and_dividing_the_batch(healthy, divisor, expected):
    s = settings(nproc_max=4)
    assert P.choose_world_size(s, healthy, divisor)[0] == expected


def test_too_few_healthy_slots_end_the_job_with_a_reason():
    d = Driver(settings(nproc_max=4, min_world_size=2))
    d.feed(P.Start())
    acts = d.feed(P.LaunchReady(1, None))
    (exit_,) = [a for a in acts if isinstance(a, P.Exit)]
    assert exit_.code == P.EXIT_BUDGET and "min_world_size 2" in exit_.reason


def test_an_unhealthy_slot_shrinks_the_next_attempt():
    d = Driver()
    d.launch(healthy=2)
    d.train(range(1, 4))
    d.feed(P.WorkersExited(1, 1))
    d.now = d.st.resume_at
    assert d.launch(healthy=1, resume=3).nproc == 1


def test_operator_stop_stops_workers_then_exits_without_restart():
    d = Driver()
    d.launch()
    acts = d.feed(P.OperatorStop("SIGINT"))
    assert any(isinstance(a, P.StopWorkers) for a in acts)
    acts = d.feed(P.WorkersExited(1, -15))
    assert [a.code for a in acts if isinstance(a, P.Exit)] == [P.EXIT_STOPPED]


def test_heartbeats_of_an_old_attempt_are_ignored():
    d = Driver()
    d.launch()
    d.train(range(1, 3))
    d.feed(P.WorkersExited(1, 1))
    d.now = d.st.resume_at
    d.launch(resume=2)
    before = d.st
    d.feed(P.Heartbeat(1, 0, 99, Phase.TRAIN))
    assert d.st == before


def test_every_logged_event_is_a_known_event():
    d = Driver()
    d.launch()
    d.train(range(1, 5))
    d.feed(P.Tick(), at=d.now + 50)
    d.feed(P.WorkersExited(1, 1))
    assert set(d.events()) <= EVENTS


def test_a_job_that_dies_at_the_same_step_without_checkpoints_is_a_crash_loop():
    d = Driver(settings(nproc_max=1, backoff_initial_s=0, max_attempts_without_progress=2))
    for _ in range(3):
        d.launch(healthy=1)
        d.train(range(1, 3), ranks=1)  # reaches step 2, never a checkpoint
        d.feed(P.WorkersExited(d.st.attempt.number, 1))
    assert [a.code for a in d.actions if isinstance(a, P.Exit)] == [P.EXIT_CRASH_LOOP]


# ---------------------------------------------------------------------- step times from the ranks' clocks


def test_a_supervisor_stall_does_not_inflate_the_learned_timeout():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)
    sent = d.now
    d.now += 20  # the supervisor did not read for 20 s; the ranks kept stepping every 0.5 s
    for step in range(11, 51):
        sent += 0.5
        d.beat_all(step, "train", sent=sent)  # all read at once, after the stall
    assert d.hb() == 2.0


def test_beats_read_after_a_supervisor_stall_keep_the_ranks_alive():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)
    d.now += 20
    d.beat_all(11, "train", sent=d.now - 19.5)  # queued long ago, read just now
    assert d.feed(P.Tick()) == []


def test_a_step_that_spans_a_save_is_not_counted_as_a_step_time():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)
    d.beat_all(10, "save", sent=d.now)
    d.now += 60
    d.beat_all(10, "train", sent=d.now)  # back from a 60 s save
    d.train(range(11, 13), dt=0.5)
    assert (max(d.st.step_times), d.hb()) == (0.5, 2.0)


def test_step_times_come_from_the_ranks_clock_not_from_when_beats_are_read():
    d = Driver()
    d.launch()
    for step in range(1, 20):
        d.now += 0.1  # read every 0.1 s, sent 2 s apart (the rank measured its steps)
        d.beat_all(step, "train", sent=2.0 * step)
    assert d.hb() == 6.0


def test_a_non_finite_save_time_is_not_a_measured_save():
    d = Driver()
    d.launch()
    d.train(range(1, 3))
    d.feed(P.Heartbeat(1, 0, 2, Phase.TRAIN, figures=(("save_s", float("nan")),)))
    assert d.st.save_times == ()


# ---------------------------------------------------------------------- phase eval


def test_a_rank_in_eval_that_keeps_beating_is_neither_a_hang_nor_stuck():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)  # heartbeat timeout 2 s, progress timeout 4 s
    for _ in range(120):  # a 60 s evaluation, beating every 0.5 s
        d.now += 0.5
        d.beat_all(10, "eval")
        d.feed(P.Tick())
    assert [e for e in d.events() if e.endswith("timed_out")] == []


def test_a_rank_silent_in_eval_past_the_heartbeat_timeout_is_a_hang():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)
    d.beat_all(10, "eval")
    d.now += 1.0
    d.feed(P.Heartbeat(1, 1, 10, Phase.EVAL))
    acts = d.feed(P.Tick(), at=d.now + 1.5)  # rank 0 silent for 2.5 s, over the learned 2 s
    assert P.StopWorkers(1, "rank 0 silent for 2.5s in phase eval (timeout 2.0s)") in acts


def test_a_rank_that_beats_in_eval_past_save_timeout_s_is_stuck():
    d = Driver()
    d.launch()
    d.train(range(1, 11), dt=0.5)
    acts: list[P.Action] = []
    for _ in range(102):  # 102 s in eval, save_timeout_s=100
        d.now += 1.0
        d.beat_all(10, "eval")
        acts += d.feed(P.Tick())
    assert P.StopWorkers(1, "rank 0 in phase eval for 101.0s (timeout 100s)") in acts


def test_a_long_eval_before_the_first_step_is_not_a_startup_timeout():
    d = Driver()
    d.launch()
    for _ in range(80):  # 80 s of eval; startup_timeout_s=60
        d.now += 1.0
        d.beat_all(0, "eval")
        d.feed(P.Tick())
    assert d.events().count("startup_timed_out") == 0


# ---------------------------------------------------------------------- what the state keeps for the daemon


def test_a_blind_health_probe_keeps_the_last_world_size():
    d = Driver(settings(nproc_max=4, backoff_initial_s=0))
    d.launch(healthy=2)
    d.train(range(1, 3))
    d.feed(P.WorkersExited(1, 1))
    assert d.launch(healthy=None).nproc == 2


def test_a_blind_health_probe_before_any_launch_takes_every_slot():
    assert Driver(settings(nproc_max=4)).launch(healthy=None).nproc == 4


def test_the_last_launch_is_kept_once_its_attempt_has_ended():
    d = Driver(settings(nproc_max=1, backoff_initial_s=0))
    d.launch(healthy=1, resume=7)
    d.feed(P.WorkersExited(1, 1))
    assert (d.st.attempt, d.st.last_launch) == (None, P.Launch(1, 1, 7))


def test_the_last_failure_is_the_reason_of_the_newest_error_logged():
    d = Driver(settings(nproc_max=1, backoff_initial_s=0, max_attempts_without_progress=2))
    for _ in range(2):
        d.launch(healthy=1)
        d.feed(P.WorkersExited(d.st.attempt.number, 1))
    errors = [a.as_dict()["reason"] for a in d.actions if isinstance(a, P.Log) and a.level == "error"]
    assert (errors[-1].startswith("crash loop: "), d.st.last_failure) == (True, errors[-1])
