"""A storage outage in the middle of a run is ridden out: the checkpoint directory replaced by a file for a few
seconds, then put back, is logged and counted by the supervisor, and the job still finishes with exit status 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.procs import PYTHONPATH, REPO, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess


def events(tmp: Path) -> list[dict]:
    path = tmp / "state" / "logs" / "supervisor.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_checkpoint_directory_replaced_by_a_file_mid_run_is_survived_and_the_job_exits_0(tmp_path: Path) -> None:
    loss = tmp_path / "loss.jsonl"
    # No periodic save (only the final one, once the directory is back): the outage is the supervisor's to ride.
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", "--steps", "100", "--ckpt-every", "1000"]
    command += ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]
    command += ["--min-step-s", "0.1", "--loss-log", str(loss)]
    cfg = {
        "job": {
            "command": command,
            "workdir": str(REPO),
            "state_dir": str(tmp_path / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "restart": {"stop_grace_s": 3},
    }
    (tmp_path / "ckpt").mkdir()
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: loss.exists() and len(loss.read_text().splitlines()) >= 3, 180, "no training step")
        (tmp_path / "ckpt").rename(tmp_path / "ckpt.aside")
        (tmp_path / "ckpt").write_text("not a directory")
        seen = lambda: proc.poll() is not None or any(e["event"] == "storage_failed" for e in events(tmp_path))  # noqa: E731
        wait_for(seen, 30, "no storage_failed")
        (tmp_path / "ckpt").unlink()
        (tmp_path / "ckpt.aside").rename(tmp_path / "ckpt")
        _, err = proc.communicate(timeout=180)
    finally:
        kill_tree(proc.pid)
    evs = events(tmp_path)
    failed = next(e for e in evs if e["event"] == "storage_failed")
    names = [e["event"] for e in evs]
    assert proc.returncode == 0, err[-3000:]
    assert (failed["purpose"], failed["path"], "storage_recovered" in names, evs[-1]["event"], evs[-1]["code"]) == (
        "checkpoint_dir",
        str(tmp_path / "ckpt"),
        True,
        "supervisor_exited",
        0,
    )
    assert names.count("workers_launched") == 1  # ridden out: not even a restart
