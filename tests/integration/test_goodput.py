"""Goodput accounting across the supervisor's own SIGKILL: a `ftsup run` started again goes on counting, and its
downtime is `other`. The accounting of a run through a SIGKILLed rank (its metrics endpoint scraped as it goes, and
`ftsup status --json` read at the end) is test_metrics_prometheus.py's: that run serves its Prometheus claims too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

import pytest

from tests.integration.test_supervisor import events, ftsup, write_job
from tests.procs import REPO, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess


def test_a_supervisor_restarted_after_sigkill_goes_on_counting_and_its_downtime_is_other(tmp_path):
    # Steps of at least 0.5 s leave seconds between the first checkpoint and the run's end, in which the
    # supervisor is killed; the ranks' parent-death guards take the attempt down with it.
    job = write_job(tmp_path, "--min-step-s", "0.5")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (tmp_path / "ckpt" / "step-000000004").is_dir(), 120, "no checkpoint of step 4")
        first = json.loads((tmp_path / "state" / "journal.json").read_text())["goodput"]
        killed_at = time.time()
        proc.kill()
        proc.wait(timeout=10)
    finally:
        kill_tree(proc.pid)
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 0, r.output[-4000:]
    starts = [stamp(e) for e in events(tmp_path) if e["event"] == "supervisor_started"]
    assert len(starts) == 2
    got = json.loads(ftsup("status", "--config", str(job), "--json", timeout=60).output)["goodput"]
    assert got["wall_s"] == pytest.approx(max(map(stamp, events(tmp_path))) - starts[0], abs=1.0)
    assert got["badput_s"]["other"] >= starts[1] - killed_at  # the supervisor's downtime, at the least
    assert got["productive_s"] > first["productive_s"]


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()
