"""The durable tier's decisions (`durable_policy`, and the eviction estimate in `policy_rules.save_fits`): which
committed checkpoints go durable, how long an upload is expected to take, which durable checkpoints retention lets
go. Pure functions, driven with values."""

from __future__ import annotations

from ftsup.store import layout
from ftsup.supervisor.config.anomaly import AnomalyConfig
from ftsup.supervisor.config.durable import DurableConfig
from ftsup.supervisor.config.forensics import ForensicsConfig
from ftsup.supervisor.config.job import HeartbeatMode
from ftsup.supervisor.durable import rules as durable_policy
from ftsup.supervisor.durable.rules import Picks, pick
from ftsup.supervisor.policy.events import Settings
from ftsup.supervisor.policy.rules import save_fits

MIB = 2**20


def info(step: int, kind: str = "periodic", consistent: bool = True) -> layout.CheckpointInfo:
    return layout.CheckpointInfo(step=step, path=f"/ckpt/{layout.step_dirname(step)}", consistent=consistent, kind=kind)


def steps_picked(cfg: DurableConfig, *looks: list[layout.CheckpointInfo]) -> list[int]:
    state, chosen = Picks(), []
    for recent in looks:
        state, got = pick(cfg, state, recent)
        chosen += [i.step for i in got]
    return chosen


def test_every_nth_periodic_checkpoint_goes_counted_across_looks() -> None:
    cfg = DurableConfig(url="s3://b-1/p", periodic_every=3)
    looks = [[], [info(1), info(2)], [info(1), info(2), info(3), info(4)], [info(5), info(6), info(7)]]
    assert steps_picked(cfg, *looks) == [3, 6]


def test_each_emergency_and_the_final_checkpoint_go_unless_the_config_says_no() -> None:
    looks = [[], [info(5), info(6, "emergency")], [info(6, "emergency"), info(7, "final")]]
    assert steps_picked(DurableConfig(url="s3://b-1/p", periodic_every=0), *looks) == [6, 7]
    assert steps_picked(DurableConfig(url="s3://b-1/p", emergency=False, final=False), *looks) == [5]


def test_the_first_look_picks_only_the_resume_point_and_an_inconsistent_one_never() -> None:
    cfg = DurableConfig(url="s3://b-1/p")
    first = [info(10), info(20), info(30, consistent=False)]
    assert steps_picked(cfg, first, [*first, info(40, consistent=False), info(50)]) == [20, 50]


def test_an_upload_is_estimated_at_the_slowest_recent_rate_or_the_first_guess() -> None:
    assert durable_policy.upload_estimate_s(640 * MIB, []) == 640 * MIB / durable_policy.FIRST_BYTES_PER_S
    assert durable_policy.upload_estimate_s(100 * MIB, [50.0 * MIB, 20.0 * MIB, 200.0 * MIB]) == 5.0
    assert (durable_policy.upload_estimate_s(None, [1.0]), durable_policy.measured_rate(MIB, 0.01)) == (None, None)


def test_durable_retention_keeps_the_newest_pins_and_a_rollbacks_history_but_not_later_timelines() -> None:
    listed = [(s, True) for s in (10, 20, 30, 40, 50, 60)] + [(70, False), (90, True)]
    doomed = durable_policy.victims(listed, keep_last=1, keep_older_than_steps=15, newest=60, pinned={10})
    assert doomed == [20, 30]  # 40 is the newest at least 15 steps older than 60, 50 younger; 90 is not this run's


def settings() -> Settings:
    return Settings(
        nproc_max=1,
        min_world_size=1,
        max_world_size=None,
        nnodes_max=1,
        standby=False,
        heartbeat_mode=HeartbeatMode.AUTO,
        heartbeat_timeout_s=None,
        progress_timeout_s=None,
        startup_timeout_s=300,
        save_timeout_s=900,
        min_timeout_s=2,
        step_time_multiplier=3,
        max_restarts=10,
        window_s=3600,
        backoff_initial_s=1,
        backoff_max_s=60,
        max_attempts_without_progress=3,
        save_margin_s=5,
        anomaly=AnomalyConfig(),
        forensics=ForensicsConfig(),
    )


def test_an_eviction_estimate_counts_the_upload_and_still_saves_when_only_the_save_fits() -> None:
    # A step of 1 s, a save of 2 s (3 s with its half again), a margin of 5 s: 9 s; an upload of 10 s on top.
    fits, why = save_fits(settings(), [1.0], [2.0], 0.0, 30.0, None, upload_s=10.0)
    late, late_why = save_fits(settings(), [1.0], [2.0], 0.0, 15.0, None, upload_s=10.0)
    assert (fits, late) == (True, True)
    assert "needs 19.0s (save ~2.00s, upload ~10.00s" in why and "not expected to be durable" not in why
    assert "the save alone fits, not its upload" in late_why
    assert save_fits(settings(), [1.0], [2.0], 0.0, 8.0, None, upload_s=10.0)[0] is False


def test_the_periodic_checkpoints_not_picked_are_the_candidates_another_node_may_follow() -> None:
    cfg = DurableConfig(url="s3://b-1/p", periodic_every=3)
    state, _, _ = durable_policy.candidates(cfg, Picks(), [])
    _, chosen, others = durable_policy.candidates(cfg, state, [info(1), info(2), info(3, "emergency"), info(4)])
    assert ([i.step for i in chosen], [i.step for i in others]) == ([3, 4], [1, 2])
