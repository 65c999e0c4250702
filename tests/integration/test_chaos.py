"""`ftsup chaos`, the reduced run: one fault of every kind (12, fixed seed) at the reference trainer
under `ftsup run` (real torchrun, gloo, CPU; two supervisors for the node loss; the store on a
size-limited tmpfs when running as root, which the CI is), every invariant checked.

One module-scoped run serves every claim; it takes about two and a half minutes on 2 busy cores. The seed is the one
of 0-4999 whose plan needs the fewest steps per job: 138 (`plan.steps_needed`; seed 1's needed 183).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftsup.tools.faults.plan import KINDS
from tests.procs import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

TIMEOUT_S = 900
SEED = 1439


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("chaos")
    out = work / "chaos.json"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "chaos", "--faults", str(len(KINDS)), "--seed", str(SEED)]
    argv += ["--restart-s", "0.5", "--dir", str(work / "d"), "--json", str(out)]
    done = run(argv, timeout=TIMEOUT_S)
    return {
        "rc": done.returncode,
        "output": done.output,
        "data": json.loads(out.read_text()) if out.exists() else None,
        "dir": work / "d",
    }


def test_the_reduced_chaos_run_exits_0_and_says_every_invariant_held(chaos: dict[str, Any]) -> None:
    assert (chaos["rc"], "PASS: every invariant held" in chaos["output"]) == (0, True), chaos["output"][-6000:]


def test_every_kind_of_fault_was_thrown_but_a_full_disk_where_no_tmpfs_can_be_mounted(chaos: dict[str, Any]) -> None:
    data = chaos["data"]
    missing = set(KINDS) - {f["kind"] for f in data["faults"]}
    assert (missing, set(data["not_run"]) <= {"disk-full"}) == (set(data["not_run"]), True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs is mounted by root")
def test_as_root_the_full_disk_is_thrown_where_a_tmpfs_can_be_mounted(chaos: dict[str, Any]) -> None:
    reason = chaos["data"]["not_run"].get("disk-full")
    assert reason is None or reason.startswith("cannot mount a tmpfs"), reason


def test_no_fault_violated_an_invariant(chaos: dict[str, Any]) -> None:
    assert {f["index"]: f["violations"] for f in chaos["data"]["faults"] if f["violations"]} == {}


def test_each_job_completed_with_the_uninterrupted_runs_losses_and_samples(chaos: dict[str, Any]) -> None:
    jobs = chaos["data"]["jobs"]
    got = {
        name: (job["exit_code"], job["violations"], job["samples"]["samples"])
        for name, job in jobs.items()
        if name != "reference"
    }
    samples = 12 * chaos["data"]["steps"]
    assert got == {"main": (0, [], samples), "nodes": (0, [], samples)}


def test_the_main_jobs_loss_log_is_bitwise_the_uninterrupted_one(chaos: dict[str, Any]) -> None:
    losses = chaos["data"]["jobs"]["main"]["loss_log"]
    assert (losses["bitwise_steps"], losses["max_rel_diff"]) == (chaos["data"]["steps"], 0.0)


def test_the_table_lists_every_kind_with_its_count(chaos: dict[str, Any]) -> None:
    rows = {row["kind"]: row["count"] for row in chaos["data"]["kinds"]}
    assert rows == {k: (0 if k in chaos["data"]["not_run"] else 1) for k in KINDS}


def test_nothing_of_any_job_is_left_running(chaos: dict[str, Any]) -> None:
    me = os.getpid()
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"], ad_value=None)
        if p.pid != me and str(chaos["dir"]) in " ".join(p.info["cmdline"] or ())
    ]
    assert left == []


def test_the_chaos_command_refuses_an_unknown_kind_with_exit_2(tmp_path: Path) -> None:
    done = run(
        [sys.executable, "-m", "ftsup.supervisor.cli", "chaos", "--kinds", "meteor", "--dir", str(tmp_path)], timeout=60
    )
    assert (done.returncode, "meteor" in done.output) == (2, True)
