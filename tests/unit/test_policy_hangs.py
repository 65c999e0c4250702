"""Collective waits and blame (`policy.hangs`), driven by a fake clock: a rank waiting for a peer in a long phase is
not hung, and a hang names the rank that stopped first."""

from __future__ import annotations

from ftsup.protocol import Phase
from ftsup.supervisor.policy import machine as P
from tests.settings import settings
from tests.unit.test_policy import Driver

DEFAULTS = settings(nproc_max=2)  # what `ftsup run` uses: min_timeout_s 2, save_timeout_s 900


def trained(d: Driver, steps: range, dt: float = 0.02) -> None:
    d.train(steps, dt=dt)
    assert d.feed(P.Tick()) == [] and d.hb() == 2.0


def stopped(acts: list[P.Action]) -> list[str]:
    return [a.reason for a in acts if isinstance(a, P.StopWorkers)]


def timed_out(d: Driver) -> dict:
    (ev,) = [a.as_dict() for a in d.actions if isinstance(a, P.Log) and a.event.endswith("_timed_out")]
    return ev


def evaluate_on_rank_0(d: Driver, step: int, seconds: float, states: tuple = ()) -> list[P.Action]:
    """Rank 0 evaluates, beating from its thread every 0.5 s; rank 1 waits in the next step's collective, silent."""
    acts = d.feed(P.Heartbeat(1, 0, step, Phase.EVAL, sent=d.now))
    end = d.now + seconds
    while d.now + 0.5 <= end and d.st.phase == "running":
        d.now += 0.5
        acts += d.feed(P.Heartbeat(1, 0, step, Phase.EVAL, sent=d.now))
        acts += d.feed(P.Tick(states))
    return acts


def test_a_rank_waiting_for_a_peer_that_evaluates_is_not_hung():
    d = Driver(DEFAULTS)
    d.launch()
    for start in range(1, 300, 50):  # 20 ms steps, rank 0 alone evaluates for 5 s every 50 steps
        trained(d, range(start, start + 50))
        assert stopped(evaluate_on_rank_0(d, start + 49, 5.0)) == []
        d.now += 0.01
        d.feed(P.Heartbeat(1, 0, start + 49, Phase.TRAIN, sent=d.now))  # back to training: the collective goes on
        assert d.feed(P.Tick(), at=d.now + 0.03) == []
    assert (d.st.phase, d.st.attempt.max_step) == ("running", 300)


def test_a_waiting_rank_has_the_heartbeat_timeout_again_once_the_long_phase_ended():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    evaluate_on_rank_0(d, 50, 5.0)
    ended = d.now
    d.feed(P.Heartbeat(1, 0, 51, Phase.TRAIN, sent=d.now))
    assert d.feed(P.Tick(), at=ended + 1.9) == []
    d.feed(P.Heartbeat(1, 0, 51, Phase.TRAIN), at=ended + 1.95)
    acts = d.feed(P.Tick(), at=ended + 2.1)  # rank 1 never came back from the collective
    assert stopped(acts) == ["rank 1 silent for 7.1s, 2.1s since the long phase it waited for ended (timeout 2.0s)"]


def test_a_stopped_rank_waits_for_no_one_even_while_a_peer_evaluates():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    acts = evaluate_on_rank_0(d, 50, 5.0, states=((0, "S"), (1, "T")))
    assert stopped(acts) == ["rank 1 stopped (SIGSTOP/state T), silent for 2.5s (timeout 2.0s)"]


def test_an_evaluation_that_stops_beating_is_blamed_and_the_rank_waiting_for_it_is_named():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    evaluate_on_rank_0(d, 50, 3.0)  # rank 1 waits meanwhile, silent for 3 s
    acts = d.feed(P.Tick(), at=d.now + 2.5)  # rank 0's evaluation thread stopped beating
    assert stopped(acts) == ["rank 0 silent for 2.5s in phase eval (timeout 2.0s); rank 1 waiting"]
    assert (timed_out(d)["rank"], timed_out(d)["waiting"]) == (0, [1])


def test_a_rank_waiting_for_a_save_on_one_rank_is_not_hung_within_save_timeout_s():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    d.feed(P.Heartbeat(1, 0, 50, Phase.SAVE, sent=d.now))  # rank 0 saves alone, silent while it does
    assert d.feed(P.Tick(), at=d.now + 600) == []
    acts = d.feed(P.Tick(), at=d.now + 301)
    assert stopped(acts) == ["rank 0 silent for 901.0s in phase save (timeout 900.0s); rank 1 waiting"]


def test_a_sigstopped_rank_is_blamed_not_the_peer_that_waits_for_it():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    d.feed(P.Heartbeat(1, 0, 51, Phase.TRAIN), at=d.now + 0.02)
    d.feed(P.Heartbeat(1, 1, 51, Phase.TRAIN), at=d.now + 0.001)  # then rank 1 is stopped; rank 0 blocks
    acts = d.feed(P.Tick(((0, "S"), (1, "T"))), at=d.now + 2.0)
    assert stopped(acts) == ["rank 1 stopped (SIGSTOP/state T), silent for 2.0s (timeout 2.0s); rank 0 waiting"]
    assert (timed_out(d)["rank"], timed_out(d)["state"], timed_out(d)["waiting"]) == (1, "T", [0])


def test_without_process_states_the_rank_behind_in_steps_is_blamed():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    d.feed(P.Heartbeat(1, 0, 51, Phase.TRAIN), at=d.now + 0.02)
    d.feed(P.Heartbeat(1, 1, 50, Phase.TRAIN), at=d.now + 0.1)  # read late: rank 1 never reported step 51
    acts = d.feed(P.Tick(), at=d.now + 1.95)
    assert stopped(acts) == ["rank 1 silent for 1.9s (timeout 2.0s); rank 0 waiting"]


def test_a_rank_in_uninterruptible_sleep_is_blamed_before_one_asleep_in_a_collective():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    acts = d.feed(P.Tick(((0, "S"), (1, "D"))), at=d.now + 2.1)
    assert stopped(acts) == [
        "rank 1 in uninterruptible sleep (state D), silent for 2.1s (timeout 2.0s); rank 0 waiting"
    ]


def test_a_rank_whose_process_is_gone_is_blamed():
    d = Driver(DEFAULTS)
    d.launch()
    trained(d, range(1, 51))
    acts = d.feed(P.Tick(((0, "S"), (1, "gone"))), at=d.now + 2.1)
    assert stopped(acts) == ["rank 1 gone, silent for 2.1s (timeout 2.0s); rank 0 waiting"]


def test_the_hang_names_the_global_rank_of_the_culprit():
    d = Driver(DEFAULTS)
    d.launch()
    for step in range(1, 51):
        d.now += 0.02
        d.feed(P.Heartbeat(1, 0, step, Phase.TRAIN, rank=4, sent=d.now))
        d.feed(P.Heartbeat(1, 1, step, Phase.TRAIN, rank=5, sent=d.now))
    acts = d.feed(P.Tick(((0, "S"), (1, "T"))), at=d.now + 2.1)
    assert stopped(acts) == ["rank 5 stopped (SIGSTOP/state T), silent for 2.1s (timeout 2.0s); rank 4 waiting"]
    assert (timed_out(d)["rank"], timed_out(d)["local_rank"]) == (5, 1)
