"""The supervisor's word when its node holds no checkpoint: a fresh start, except on a node of a job whose peers'
memories hold replicas, where the ranks load the newest step the peers hold."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from structlog.testing import capture_logs

from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.run.daemon import Daemon


@pytest.fixture(autouse=True)
def restore_structlog() -> Any:
    old = structlog.get_config()
    yield
    structlog.configure(**old)


def chosen(tmp: Path, launch: dict[str, Any], checkpoint: dict[str, Any]) -> str:
    cfg = {
        "job": {"command": [sys.executable, "-c", "pass"], "workdir": str(tmp), "state_dir": str(tmp / "state")},
        "launch": {"nproc_per_node": 1, "health_command": [sys.executable, "-c", "print('slot 0 is fine')"], **launch},
        "checkpoint": {"dir": str(tmp / "ckpt"), **checkpoint},
    }
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    daemon = Daemon(load_config(tmp / "job.yaml", hostname="node-b"))
    with capture_logs() as logs:
        daemon.resume.prepare(1)
    [event] = [e for e in logs if e["event"] == "checkpoint_chosen"]
    assert event["step"] is None
    return str(event["reason"])


TWO_NODES = {"nnodes": "2", "rdzv_endpoint": "127.0.0.1:29400"}


def test_a_node_of_a_job_with_replicas_in_its_peers_memories_says_the_ranks_may_load_from_them(tmp_path: Path) -> None:
    memory = {"memory": {"dir": str(tmp_path / "shm"), "replicas": 1}}
    assert "peers' memories" in chosen(tmp_path, TWO_NODES, memory)


@pytest.mark.parametrize(
    ("launch", "checkpoint"),
    [({}, {"memory": {"replicas": 1}}), (TWO_NODES, {}), (TWO_NODES, {"memory": {"replicas": 0}})],
    ids=["one-node", "no-memory-tier", "no-replicas"],
)
def test_otherwise_no_checkpoint_is_a_fresh_start(tmp_path: Path, launch: dict, checkpoint: dict) -> None:
    if "memory" in checkpoint:
        checkpoint = {"memory": {"dir": str(tmp_path / "shm"), **checkpoint["memory"]}}
    assert chosen(tmp_path, launch, checkpoint) == "no checkpoint: fresh start"
