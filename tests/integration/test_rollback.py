"""`ftsup rollback` against a running `ftsup run` of the reference trainer (real torchrun, gloo, CPU): the job
stops, resumes from the chosen step with the requested data skip in its ranks' environment, journals the request
as served, abandons the checkpoints after the step, and finishes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ftsup.store import layout
from tests.integration.test_supervisor import events, ftsup, write_job
from tests.procs import PYTHONPATH, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess


def journal(tmp: Path) -> dict:
    try:
        return json.loads((tmp / "state" / "journal.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def loss_steps(tmp: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (tmp / "loss.jsonl").read_text().splitlines() if line]
    except FileNotFoundError:
        return []


def ftsup_env(tmp: Path, attempt: int) -> dict[str, str] | None:
    """The FTSUP_* variables of a running rank of `attempt`, or None while there is none."""
    rec = journal(tmp)
    if rec.get("attempt") != attempt:
        return None
    for pid in rec.get("pids", []):
        try:  # a rank's (torchrun's own environment may be a spare agent's, fixed when it was parked)
            env = psutil.Process(pid).environ()
        except psutil.Error:
            continue
        if env.get("FTSUP_ATTEMPT") == str(attempt) and "LOCAL_RANK" in env:
            return {k: v for k, v in env.items() if k.startswith("FTSUP_")}
    return None


def test_ftsup_rollback_resumes_a_running_job_from_the_step_with_the_skip(tmp_path: Path):
    job = write_job(tmp_path, "--steps", "40", "--min-step-s", "0.3", "--keep-last", "20")
    out = open(tmp_path / "supervisor.out", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: max(loss_steps(tmp_path), default=0) >= 17, 180, "the job never reached step 17")
        request = ("--to-step", "8", "--skip-samples", "96:120", "--reason", "a test")
        asked = ftsup("rollback", "--config", str(job), *request, timeout=60)
        env = wait_for(lambda: ftsup_env(tmp_path, 2), 120, lambda: f"no attempt 2; journal {journal(tmp_path)}")
        assert proc.wait(timeout=240) == 0, (tmp_path / "supervisor.out").read_text()[-4000:]
    finally:
        kill_tree(proc.pid)
        out.close()
    rec = journal(tmp_path)
    launched = [e for e in events(tmp_path) if e["event"] == "workers_launched"]
    requested = [e for e in events(tmp_path) if e["event"] == "rollback_requested"]
    seen = {
        "asked": (asked.returncode, "the running supervisor serves it" in asked.output),
        "env": (env.get("FTSUP_RESUME_STEP"), env.get("FTSUP_RESUME_BOUND"), env.get("FTSUP_DATA_SKIPS")),
        "journal": (rec["skips"], len(rec["rollbacks_served"]), rec["incident"]["kind"]),
        "launched": [e["resume_step"] for e in launched],
        "requested": [(e["to_step"], e["reason"], e["who"].split(" pid ")[0] != "") for e in requested],
        "step 9 again": loss_steps(tmp_path).count(9),
        "abandoned": all((tmp_path / "ckpt" / f"{layout.step_dirname(s)}.abandoned").is_dir() for s in (12, 16)),
    }
    assert seen == {
        "asked": (0, True),
        "env": ("8", "8", "96:120"),
        "journal": ([[96, 120]], 1, "operator"),
        "launched": [None, 8],
        "requested": [(8, "a test", True)],
        "step 9 again": 2,
        "abandoned": True,
    }


def test_a_rollback_asked_for_while_no_supervisor_runs_is_where_the_next_run_starts(tmp_path: Path):
    job = write_job(tmp_path, "--steps", "12", "--keep-last", "10")
    first = ftsup("run", "--config", str(job))
    assert first.returncode == 0, first.output[-4000:]
    asked = ftsup("rollback", "--config", str(job), "--to-step", "4", "--skip-samples", "48:60", timeout=60)
    again = ftsup("run", "--config", str(job))
    assert again.returncode == 0, again.output[-4000:]
    launched = [e["resume_step"] for e in events(tmp_path) if e["event"] == "workers_launched"]
    seen = (
        asked.returncode,
        "the next `ftsup run` starts from it" in asked.output,
        launched,
        journal(tmp_path)["skips"],
        loss_steps(tmp_path).count(5),
    )
    assert seen == (0, True, [None, 4], [[48, 60]], 2)
