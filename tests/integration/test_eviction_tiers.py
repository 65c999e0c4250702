"""An eviction whose deadline (5 s) the durable tier is too slow for (SeaweedFS behind an endpoint that answers
every shard upload a byte at a time): the emergency checkpoint lands in the node's memory first, then on disk, the
supervisor reports the tiers it reached before the deadline (log, metric, `ftsup status`), and a relaunch on the same
node resumes from the memory tier's copy with no step lost (docs/evictions-and-durable.md, Where the emergency
checkpoint landed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.store import layout
from ftsup.supervisor.policy.machine import EXIT_EVICTED
from tests import lying_s3 as lies
from tests.hostile_s3 import Reply, Request
from tests.lying_s3 import LyingS3
from tests.procs import PYTHONPATH, REPO, kill_tree, run, wait_for
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.multiprocess

STEPS = 14
MODEL = ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]


def write_job(tmp: Path, endpoint: str, bucket: str) -> Path:
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", *MODEL, "--steps", str(STEPS), "--ckpt-every", "5"]
    command += ["--min-step-s", "0.3", "--loss-log", str(tmp / "loss.jsonl")]
    tier = {"url": f"s3://{bucket}/job", "endpoint_url": endpoint, "request_timeout_s": 2}
    cfg = {
        "job": {"command": command, "workdir": str(REPO), "state_dir": str(tmp / "state")},
        "launch": {"nproc_per_node": 2, "warm_agent": False},
        "checkpoint": {"dir": str(tmp / "ckpt"), "memory": {"dir": str(tmp / "shm")}, "durable": tier},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
        "eviction": {"poll_interval_s": 0.1, "default_deadline_s": 5, "save_margin_s": 1},
    }
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "job.yaml"


def events(tmp: Path, name: str) -> list[dict[str, Any]]:
    path = tmp / "state" / "logs" / "supervisor.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == name]


def steps_logged(tmp: Path) -> list[int]:
    log = tmp / "loss.jsonl"
    return [json.loads(x)["step"] for x in log.read_text().splitlines()] if log.exists() else []


class SlowUploads:
    """Every shard file's upload answered a byte every half second (never in time); the rest forwarded."""

    def __init__(self) -> None:
        self.store: LyingS3 | None = None
        self.slow = True

    def __call__(self, request: Request) -> Reply | None:
        if self.slow and request.method in ("PUT", "POST") and ".safetensors" in request.key and self.store:
            return Reply(200, self.store.trickle(lies.XML_HEAD * 10, 0.5), {})
        return None


def test_an_eviction_with_a_durable_tier_too_slow_lands_in_memory_first_and_resumes_from_it_losing_nothing(
    bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    slow = SlowUploads()
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    with LyingS3(s3_server.endpoint, slow) as store:
        slow.store = store
        job = write_job(tmp_path, store.endpoint, bucket)
        argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: len(steps_logged(tmp_path)) >= 6 or proc.poll() is not None, 180, "never trained")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == EXIT_EVICTED
        finally:
            kill_tree(proc.pid)
        reached = steps_logged(tmp_path)[-1]
        [report] = events(tmp_path, "emergency_tiers_reached")
        noticed = events(tmp_path, "eviction_noticed")[0]
        status = run(
            [sys.executable, "-m", "ftsup.supervisor.cli", "status", "--config", str(job), "--json"], timeout=60
        )
        in_memory = [(s, layout.read_manifest(path).kind) for s, path in layout.committed_dirs(tmp_path / "shm")]
        # The relaunch on the same node: the memory tier holds the emergency checkpoint, read from there.
        slow.slow = False  # the tier answers again, so that the finished job's final checkpoint becomes durable
        again = run(argv, timeout=240)
    assert (report["step"], report["tiers"], report["source"]) == (reached, ["memory", "disk"], "signal:SIGTERM")
    left = report["left_s"]
    assert 0 < left["disk"] <= left["memory"] <= noticed["deadline_in_s"], report  # memory first, both in time
    assert in_memory == [(reached, "emergency")]
    assert json.loads(status.output)["last_eviction"]["tiers"] == ["memory", "disk"], status.output
    assert again.returncode == 0, again.output[-3000:]
    launched = events(tmp_path, "workers_launched")
    relaunch = (tmp_path / "state" / "logs" / "attempt-0002.log").read_text()
    assert (launched[-1]["resume_step"], relaunch.count("tier=memory")) == (reached, 2), relaunch[-3000:]
    assert steps_logged(tmp_path)[reached:] == list(range(reached + 1, STEPS + 1))  # step reached + 1 next: 0 lost
