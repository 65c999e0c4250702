"""A finished job whose final checkpoint does not reach the durable tier says so in its exit status (9), not only in
a warning. The reference trainer under `ftsup run` with a durable tier on a path, where another writer's checkpoint
of the final step is committed already: the tier refuses the upload (a committed step is never overwritten)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ftsup.supervisor.policy.machine import EXIT_NOT_DURABLE
from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import PYTHONPATH, REPO, kill_tree

pytestmark = pytest.mark.multiprocess

TRAINER = ["-m", "ftsup.trainer.examples.gpt", "--ckpt-every", "100"]
TRAINER += ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]
STEPS = 4


def test_a_finished_job_whose_final_checkpoint_is_not_durable_exits_9(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path / "durable", STEPS, default_files(), kind="final")  # another writer's step 4
    cfg = {
        "job": {
            "command": [sys.executable, *TRAINER, "--steps", str(STEPS)],
            "workdir": str(REPO),
            "state_dir": str(tmp_path / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 1, "warm_agent": False},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "durable": {"url": str(tmp_path / "durable")}},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(tmp_path / "job.yaml")],
        env=dict(os.environ, PYTHONPATH=PYTHONPATH),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        rc = proc.wait(timeout=240)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    logged = [json.loads(x) for x in (tmp_path / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]
    names = [e["event"] for e in logged]
    missed = [e for e in logged if e["event"] == "durable_deadline_missed"]
    journal = json.loads((tmp_path / "state" / "journal.json").read_text())
    assert (rc, "job_succeeded" in names, [e["step"] for e in missed], journal["status"]) == (
        EXIT_NOT_DURABLE,
        True,
        [STEPS],
        "succeeded",
    ), names
