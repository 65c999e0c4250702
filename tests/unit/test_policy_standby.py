"""A hot spare's attempts in the policy: its wait in the rendezvous is no failure, a round that ends before its ranks
started releases it to the next, a job finished without it ends it with exit 0."""

from __future__ import annotations

import dataclasses

from ftsup.supervisor.config.job import HeartbeatMode
from ftsup.supervisor.policy import machine as P
from ftsup.supervisor.policy.events import RanksStarted
from tests.unit.test_policy import Driver, S

SPARE = dataclasses.replace(S, nnodes_max=2, standby=True)
ACTIVE = dataclasses.replace(S, nnodes_max=2, heartbeat_mode=HeartbeatMode.REQUIRED)


def test_a_round_that_ends_before_the_spares_ranks_started_releases_it_without_a_restart() -> None:
    d = Driver(SPARE)
    d.launch(resume=8)
    acts = d.feed(P.WorkersExited(1, 1, output=("RendezvousConnectionError",)), at=3.0)
    assert (d.st.phase, d.st.restarts, d.st.standby_releases) == ("backoff", (), 1)
    assert d.events()[-1] == "standby_released" and not any(isinstance(a, P.Exit) for a in acts)
    assert d.st.resume_at == 3.0  # the first release in a row: at once
    d.launch()
    d.feed(P.WorkersExited(2, 1), at=5.0)
    assert (d.st.standby_releases, d.st.resume_at) == (2, 5.0 + S.backoff_initial_s)  # then the backoff


def test_releases_never_spend_the_restart_budget_or_count_as_no_progress() -> None:
    d = Driver(SPARE)
    for n in range(1, 20):  # more than max_restarts and max_attempts_without_progress
        d.launch()
        assert d.st.attempt is not None
        d.feed(P.WorkersExited(n, 1), at=d.st.attempt.launched_at + 100)  # a long wait: released at once
        assert (d.st.phase, d.st.resume_at) == ("backoff", d.now)
    assert "job_failed" not in d.events() and d.st.restarts == ()


def test_a_spare_that_joined_is_a_member_whose_failure_counts() -> None:
    d = Driver(SPARE)
    d.launch()
    d.feed(RanksStarted(1), at=50.0)
    assert d.events()[-1] == "standby_joined" and d.st.attempt is not None and d.st.attempt.ranks_at == 50.0
    d.feed(P.WorkersExited(1, 1), at=51.0)
    assert "standby_released" not in d.events() and len(d.st.restarts) == 1


def test_no_startup_timeout_while_a_multi_node_attempt_waits_in_its_rendezvous() -> None:
    d = Driver(ACTIVE)
    d.launch()
    d.feed(P.Tick(), at=S.startup_timeout_s * 10)
    assert d.st.phase == "running"
    d.feed(RanksStarted(1))
    d.feed(P.Tick(), at=d.now + S.startup_timeout_s + 1)
    assert "startup_timed_out" in d.events()


def test_a_spare_whose_job_finished_without_it_exits_0() -> None:
    d = Driver(SPARE)
    d.feed(P.Start())
    acts = d.feed(P.LaunchReady(2, 60, resume_final=True))
    assert [a.code for a in acts if isinstance(a, P.Exit)] == [P.EXIT_OK] and d.st.phase == "done"


def test_a_spares_ranks_get_no_resume_bound_unless_a_rollback_sets_one() -> None:
    d = Driver(SPARE)
    assert d.launch(resume=8).resume_step is None
    active = Driver(ACTIVE)
    assert active.launch(resume=8).resume_step == 8
