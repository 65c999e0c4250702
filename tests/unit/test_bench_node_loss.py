"""`ftsup bench node-loss`'s pure parts: the loss schedule, what a loss cost as read from a loss log written by hand,
the accounting's timeline, the tiers the resumes read, the checks, and each contender's config and command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup.protocol import NODE_ID_ENV, NODE_LOCAL_ENV
from ftsup.supervisor.config.job import parse_config
from ftsup.tools.bench.goodput import nodeloss, twonode
from ftsup.tools.bench.goodput.account import OTHER, account
from ftsup.tools.bench.goodput.contenders import NVRX_LAUNCHER, NVRX_RANK, TRAINER
from ftsup.tools.bench.goodput.nodeloss import Loss, StepLine
from ftsup.tools.bench.goodput.schedule import plan
from ftsup.tools.faults.refjob import TrainerJob


def steps(t0: float, first: int, last: int, world_size: int, dt: float = 0.1) -> list[StepLine]:
    return [StepLine(t0 + i * dt, s, world_size) for i, s in enumerate(range(first, last + 1))]


# --------------------------------------------------------------------------- the schedule


def test_loss_times_are_the_goodput_schedules_kills_for_the_seed() -> None:
    want = [f.at_s for f in plan(5, 20, {"kill": 1.0}, nproc=1, horizon_s=1000)[:3]]
    assert nodeloss.loss_times(5, 20, 3, 1000) == want and len(want) == 3


def test_another_seed_gives_other_loss_times() -> None:
    assert nodeloss.loss_times(5, 20, 3, 1000) != nodeloss.loss_times(6, 20, 3, 1000)


# --------------------------------------------------------------------------- a loss read from the loss log


# Both nodes train steps 1-30, node B is lost at t=10 (when step 30 was the newest line seen); steps 31-32 were
# written before the kill but seen after it; the survivor resumes alone from step 20 at t=20 and trains to 40; the
# replacement starts at t=30 and both train again from step 40 (the survivor's checkpoint) at t=45.
LOSS = Loss(t=10.0, max_step_before=30, back_t=30.0)
LOG = [
    *steps(7.0, 1, 30, 2, dt=0.1),
    StepLine(10.02, 31, 2),
    StepLine(10.04, 32, 2),
    *steps(20.0, 21, 40, 1, dt=0.5),
    *steps(45.0, 41, 60, 2, dt=0.1),
]


def test_lines_seen_after_the_loss_that_go_on_at_both_nodes_world_size_were_written_before_it() -> None:
    first, reached, stopped = nodeloss.resumed(LOG, LOSS)
    assert (first, reached, stopped) == (StepLine(20.0, 21, 1), 32, 10.04)


def test_a_loss_costs_the_steps_past_the_checkpoint_and_the_rejoin_costs_none_past_the_survivors() -> None:
    got = nodeloss.per_loss(LOG, LOSS, t0=0.0)
    assert {k: got[k] for k in ("first_step", "world_size_after", "lost_steps", "lost_steps_rejoin")} == {
        "first_step": 21,
        "world_size_after": 1,
        "lost_steps": 12,
        "lost_steps_rejoin": 0,
    }
    assert (got["recover_s"], got["rejoin_s"], got["lost_steps_total"]) == (10.0, 15.0, 12)


def test_a_job_that_resumed_only_once_both_nodes_were_back_counts_one_restart() -> None:
    log = [*steps(7.0, 1, 30, 2), *steps(40.0, 21, 40, 2)]
    got = nodeloss.per_loss(log, Loss(10.0, 30, 30.0), t0=0.0)
    assert (got["first_step"], got["lost_steps"], got["lost_steps_rejoin"], got["recover_s"]) == (21, 10, 0, 30.0)


def test_a_loss_the_job_never_came_back_from_has_no_figures() -> None:
    got = nodeloss.per_loss(steps(7.0, 1, 30, 2), Loss(10.0, 30, None), t0=0.0)
    assert (got["first_step"], got["lost_steps"], got["rejoin_s"], got["lost_steps_total"]) == (None, None, None, None)


def test_a_replacement_that_never_trained_before_the_survivor_finished_cost_no_steps() -> None:
    log = [*steps(7.0, 1, 30, 2), *steps(20.0, 21, 60, 1)]
    got = nodeloss.per_loss(log, Loss(10.0, 30, 22.0), t0=0.0)
    assert (got["rejoin_s"], got["lost_steps_rejoin"], got["lost_steps_total"]) == (None, 0, 10)


def test_a_survivor_that_finished_alone_lost_only_the_steps_of_its_own_resume() -> None:
    log = [*steps(7.0, 1, 30, 2), *steps(20.0, 21, 40, 1)]
    assert nodeloss.per_loss(log, Loss(10.0, 30, None), t0=0.0)["lost_steps_total"] == 10


def test_a_rejoin_counts_the_steps_past_its_checkpoint_from_where_the_survivor_was_not_the_most_ever_reached() -> None:
    log = [*steps(7.0, 1, 30, 2), *steps(20.0, 1, 12, 1), *steps(40.0, 11, 20, 2)]
    got = nodeloss.per_loss(log, Loss(10.0, 30, 30.0), t0=0.0)
    assert (got["lost_steps"], got["lost_steps_rejoin"], got["lost_steps_total"]) == (30, 2, 32)


def test_a_restart_from_scratch_loses_every_step() -> None:
    log = [*steps(7.0, 1, 30, 2), *steps(30.0, 1, 10, 2)]
    assert nodeloss.per_loss(log, Loss(10.0, 30, 25.0), t0=0.0)["lost_steps_total"] == 30


def test_the_timeline_has_the_loss_from_its_last_line_and_every_other_restart_as_other() -> None:
    tl = nodeloss.timeline(LOG, [LOSS], t0=0.0, end=50.0, save_every=10)
    assert [(c.t, c.kind) for c in tl.interruptions] == [(10.04, "kill"), (LOG[-21].t, OTHER)]


def test_the_accounting_of_a_node_loss_adds_up_to_the_wall_time() -> None:
    acc = account(nodeloss.timeline(LOG, [LOSS], t0=0.0, end=50.0, save_every=10))
    assert (round(acc.productive_s + sum(acc.badput_s.values()), 6), acc.steps, acc.redone_steps) == (50.0, 60, 12)


# --------------------------------------------------------------------------- tiers, checks, the table

PEERS = """[rank0]: 10:56:38 [info     ] checkpoint_loaded bytes_read=1 duration_s=0.9 rank=0 step=130 tier=peers
[rank1]: 10:56:38 [info     ] checkpoint_loaded bytes_read=1 duration_s=0.9 rank=1 step=130 tier=peers
"""
DURABLE = """[rank0]: ... checkpoint_node_read durable_files=2 local_files=1 path=/a rank=0 step=110
[rank0]: ... checkpoint_loaded bytes_read=1 duration_s=0.98 path=/a rank=0 step=110 tier=fast
[rank0]: ... checkpoint_node_read durable_files=0 local_files=3 path=/a rank=0 step=120
[rank0]: ... checkpoint_loaded bytes_read=1 duration_s=0.98 path=/a rank=0 step=120 tier=fast
"""


def test_loads_name_the_tier_each_rank_logged() -> None:
    assert nodeloss.loads(PEERS) == [
        {"tier": "peers", "step": 130, "rank": 0},
        {"tier": "peers", "step": 130, "rank": 1},
    ]


def test_a_node_local_load_that_read_files_from_the_durable_tier_is_the_durable_tiers() -> None:
    assert [x["tier"] for x in nodeloss.loads(DURABLE)] == ["durable", "fast"]


def test_the_check_passes_only_where_the_peer_tier_is_above_each_other_contender() -> None:
    rows = [{"name": "ftsup-peers", "goodput": 0.8, "completed": True}]
    rows += [{"name": "ftsup-durable", "goodput": 0.7, "completed": True}]
    rows += [{"name": "torchrun", "goodput": 0.85, "completed": True}]
    assert nodeloss.checks(rows) == {
        "peers_over_ftsup_durable": {"margin": 0.1, "completed": [True, True], "pass": True},
        "peers_over_torchrun": {"margin": -0.05, "completed": [True, True], "pass": False},
    }


def test_a_contender_whose_job_did_not_complete_is_below_one_that_did_whatever_its_goodput_so_far() -> None:
    rows = [{"name": "ftsup-peers", "goodput": 0.4, "completed": True}]
    rows += [{"name": "nvrx-tuned", "goodput": 0.6, "completed": False}]
    assert nodeloss.checks(rows)["peers_over_nvrx_tuned"] == {
        "margin": -0.2,
        "completed": [True, False],
        "pass": True,
    }


def test_a_contender_that_did_not_run_leaves_its_check_unmeasured() -> None:
    rows = [{"name": "ftsup-peers", "goodput": 0.8}, nodeloss.not_run("torchrun", "torchrun", "no torch")]
    assert nodeloss.checks(rows)["peers_over_torchrun"]["pass"] is None


def test_the_table_has_a_line_per_contender() -> None:
    acc = account(nodeloss.timeline(LOG, [LOSS], t0=0.0, end=50.0, save_every=10))
    losses = [nodeloss.per_loss(LOG, LOSS, 0.0)]
    row = nodeloss.row("ftsup-peers", "ftsup run", acc, losses, nodeloss.loads(PEERS), completed=True)
    text = nodeloss.table({"results": [row, nodeloss.not_run("torchrun", "torchrun", "no torch")], "checks": {}})
    assert [ln.split()[:2] for ln in text.splitlines()[2:4]] == [
        ["ftsup-peers", f"{acc.goodput:.3f}"],
        ["torchrun", "not"],
    ]


# --------------------------------------------------------------------------- the contenders


def job(tmp_path: Path) -> twonode.TwoNodeJob:
    base = TrainerJob(tmp_path, "nl-test", 40, ckpt_every=10, nproc=1)
    return twonode.TwoNodeJob(base, 29500, tmp_path / "shm", max_restarts=7)


def test_torchrun_runs_elastic_on_two_nodes_resuming_from_its_node_local_dir(tmp_path: Path) -> None:
    j = job(tmp_path)
    a, b = j.nodes()
    argv = twonode.NodeContender("torchrun").argv(j, b)
    flags = argv[argv.index("torch.distributed.run") + 1 : argv.index("-m", 3)]
    assert flags[:5] == [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29500",
        "--rdzv-id=nl-test",
    ]
    assert flags[-1] == "--max-restarts=7" and argv[-2:] == ["--ckpt-dir", str(b.disk)] and a.disk != b.disk
    env = twonode.NodeContender("torchrun").env(b, {})
    assert (env[NODE_LOCAL_ENV], env[NODE_ID_ENV]) == ("1", b.node_id)


def test_ftsup_peers_has_node_local_dirs_and_a_replica_in_the_peers_memory_and_no_durable_tier(tmp_path: Path) -> None:
    j = job(tmp_path)
    _, b = j.nodes()
    cfg = parse_config(twonode.NodeContender("ftsup-peers").config(j, b), base_dir=tmp_path)
    assert (cfg.checkpoint.dir_shared, cfg.checkpoint.durable, cfg.launch.nnodes, cfg.launch.node_id) == (
        False,
        None,
        "1:2",
        b.node_id,
    )
    assert cfg.checkpoint.memory is not None and cfg.checkpoint.memory.replicas == 1
    assert str(cfg.checkpoint.memory.dir).startswith(str(tmp_path / "shm"))


def test_ftsup_durable_has_the_durable_tier_and_no_memory_tier(tmp_path: Path) -> None:
    j = job(tmp_path)
    a, _ = j.nodes()
    cfg = parse_config(twonode.NodeContender("ftsup-durable", "s3://bench/job").config(j, a), base_dir=tmp_path)
    assert (cfg.checkpoint.dir_shared, cfg.checkpoint.memory, cfg.checkpoint.durable is not None) == (False, None, True)


def test_a_wipe_takes_only_the_nodes_own_dirs(tmp_path: Path) -> None:
    j = job(tmp_path)
    a, b = j.nodes()
    assert (b.disk.parent, b.state.parent, j.memory(b).parent) == (b.home, b.home, tmp_path / "shm")
    assert not str(a.home).startswith(str(b.home)) and not str(j.memory(a)).startswith(str(j.memory(b)))


def test_nnodes_2_2_makes_every_launcher_wait_for_the_replacement(tmp_path: Path) -> None:
    j = twonode.TwoNodeJob(TrainerJob(tmp_path, "nl-test", 40, nproc=1), 29500, tmp_path / "shm", 7, nnodes="2:2")
    a, _ = j.nodes()
    argv = twonode.NodeContender("torchrun").argv(j, a)
    cfg = parse_config(twonode.NodeContender("ftsup-peers").config(j, a), base_dir=tmp_path)
    assert ("--nnodes=2:2" in argv, cfg.launch.nnodes) == (True, "2")  # the config normalizes N:N to N


def test_ft_launcher_runs_as_torchrun_does_with_its_heartbeat_rank_and_tuned_timeouts(tmp_path: Path) -> None:
    j = job(tmp_path)
    _, b = j.nodes()
    nvrx, plain = twonode.NodeContender("nvrx-tuned").argv(j, b), twonode.NodeContender("torchrun").argv(j, b)
    assert nvrx[2] == NVRX_LAUNCHER and nvrx[nvrx.index("-m", 3) + 1] == NVRX_RANK
    assert set(plain[3:]) - {TRAINER, "torch.distributed.run"} <= set(nvrx) and "--ft-rank-heartbeat-timeout=3" in nvrx


def test_unknown_contenders_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="nvrx-default"):
        twonode.contenders(["ftsup-peers", "nvrx-default"], None)
