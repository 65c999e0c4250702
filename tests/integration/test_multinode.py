"""Two supervisors on 127.0.0.1 acting as two nodes of one job (c10d rendezvous, --nnodes 1:2).

Node B is stopped (its supervisor SIGKILLed; its torchrun and ranks follow through their
parent-death guards); node A relaunches on its own from the latest checkpoint at the smaller
world size; B started again joins, and the job completes with every step's samples in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ftsup.store import layout
from tests.procs import PYTHONPATH, REPO, free_port, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

STEPS = 60


def node_config(
    tmp: Path,
    node: str,
    port: int,
    *,
    run_id: str = "mn-test",
    checkpoint: dict | None = None,
    local_addr: str | None = None,
    **sections: dict,
) -> Path:
    """Node `node`'s job file; `checkpoint` replaces the shared store of `tmp / "ckpt"`, `local_addr` is torchrun's
    address for the node (its rank in a round: nodes are ranked by address, then agent pid), `sections` are added."""
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", "--steps", str(STEPS), "--ckpt-every", "4"]
    command += ["--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--corpus-bytes", "200000"]
    command += ["--min-step-s", "0.15", "--loss-log", str(tmp / "loss.jsonl")]
    cfg = {
        "job": {
            "command": command,
            "workdir": str(REPO),
            "run_id": run_id,
            "state_dir": str(tmp / node),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {
            "nproc_per_node": 1,
            "nnodes": "1:2",
            "rdzv_endpoint": f"127.0.0.1:{port}",
            "node_id": node,
            "torchrun_args": ["--rdzv-conf=last_call_timeout=2,join_timeout=120,read_timeout=10"]
            + ([f"--local-addr={local_addr}"] if local_addr else []),
        },
        "checkpoint": checkpoint or {"dir": str(tmp / "ckpt")},
        "restart": {"backoff_initial_s": 0.5, "stop_grace_s": 3, "max_attempts_without_progress": 5},
        **sections,
    }
    path = tmp / f"{node}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(cfg: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    return subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(cfg)],
        env=env,
        stdout=open(out, "ab"),
        stderr=subprocess.STDOUT,
    )


def lines(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")] if log.exists() else []


def assert_every_step_once_in_order(loss_log: Path) -> None:
    """Every step of the job trained, the last time each was, on the samples that follow the step before."""
    final: dict[int, dict] = {}
    for j in lines(loss_log):
        final[j["step"]] = j
    assert sorted(final) == list(range(1, STEPS + 1))
    assert [final[s]["samples"] for s in sorted(final)] == [12 * s for s in range(1, STEPS + 1)]


def test_losing_a_node_relaunches_smaller_and_the_node_can_rejoin(tmp_path):
    # B's address ranks it first in every round it is in: A, alone after B's loss, is rank 0 of its round and then
    # rank 1 of the round B rejoins, its torchrun restarting its worker in place. With torchrun's store shared with
    # the workers, A's agent kept the bootstrap address of the round it led: the two workers waited for each other in
    # init_process_group at two stores, or failed to connect, and both nodes relaunched (docs/design/run-loop.md,
    # the workers' store).
    port = free_port()
    a_cfg = node_config(tmp_path, "node-a", port, local_addr="127.0.0.2", heartbeat={"startup_timeout_s": 90})
    b_cfg = node_config(tmp_path, "node-b", port, local_addr="127.0.0.1", heartbeat={"startup_timeout_s": 90})
    a = start(a_cfg, tmp_path / "a.out")
    b = start(b_cfg, tmp_path / "b.out")
    b2 = None
    try:
        wait_for(
            lambda: any(j["world_size"] == 2 for j in lines(tmp_path / "loss.jsonl")),
            120,
            "the two nodes never trained together",
        )
        wait_for(
            lambda: (i := layout.latest_consistent(tmp_path / "ckpt")) is not None and i.step >= 8, 120, "no checkpoint"
        )
        b.kill()
        b.wait(timeout=10)
        saved = layout.latest_consistent(tmp_path / "ckpt").step
        wait_for(
            lambda: any(j["world_size"] == 1 for j in lines(tmp_path / "loss.jsonl")),
            120,
            "node A never continued alone",
        )
        alone = [j for j in lines(tmp_path / "loss.jsonl") if j["world_size"] == 1]
        assert alone[0]["step"] <= saved + 4 + 1  # resumed from a checkpoint at most one interval back
        solo_saved = alone[0]["step"] - 1 + 3 * 4  # three checkpoints A commits alone, so a rejoin can lose them
        wait_for(
            lambda: (i := layout.latest_consistent(tmp_path / "ckpt")) is not None and i.step >= solo_saved,
            120,
            f"node A alone never committed step {solo_saved}",
        )
        b2 = start(b_cfg, tmp_path / "b2.out")
        assert a.wait(timeout=240) == 0, (tmp_path / "a.out").read_text()[-3000:]
        assert b2.wait(timeout=60) == 0, (tmp_path / "b2.out").read_text()[-3000:]
    finally:
        for p in (a, b, b2):
            if p is not None:
                kill_tree(p.pid)
    assert_every_step_once_in_order(tmp_path / "loss.jsonl")
    # The round B rejoins resumes from A's newest checkpoint, not from the one A's attempt was launched with (its
    # ranks restarted in place keep their launch's environment): it trains again at most two intervals of A's.
    logged = lines(tmp_path / "loss.jsonl")
    solo = next(i for i, j in enumerate(logged) if j["world_size"] == 1)
    rejoin = next(i for i in range(solo, len(logged)) if logged[i]["world_size"] == 2)
    assert logged[rejoin - 1]["step"] - (logged[rejoin]["step"] - 1) <= 2 * 4, logged[solo : rejoin + 1]
    a_events = [json.loads(x) for x in (tmp_path / "node-a" / "logs" / "supervisor.jsonl").read_text().splitlines()]
    launches = [e for e in a_events if e["event"] == "workers_launched"]
    assert len(launches) >= 2 and launches[1]["resume_step"] is not None
    b_events = [json.loads(x) for x in (tmp_path / "node-b" / "logs" / "supervisor.jsonl").read_text().splitlines()]
    assert [e for e in a_events + b_events if e["event"].endswith("_timed_out")] == []
    # The rejoin is a restart in place on A and B's one launch: neither node's workers failed after it.
    rejoined = next((i for i, e in enumerate(a_events) if e["event"] == "workers_restarted"), None)
    assert rejoined is not None, "A's torchrun never restarted its worker for the round B rejoined"
    b_launches = [e for e in b_events if e["event"] == "workers_launched"]
    failed = [e for e in a_events[rejoined:] + b_events if e["event"] == "worker_exited" and e["attempt"] > 1]
    assert (len(b_launches), failed) == (2, []), failed
