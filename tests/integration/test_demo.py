"""`ftsup demo`, run small for real (24 steps, real torchrun, gloo, CPU): it recovers from a
SIGKILLed rank, a SIGSTOPped rank and a SIGKILLed supervisor, says the loss logs matched
bitwise, and leaves nothing running. One module-scoped run serves every claim.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.procs import run

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 170
STEPS = 24


def processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line or environment contains `text` (zombies excluded)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ", "status"], ad_value=None):
        info = p.info
        blob = " ".join(info["cmdline"] or ()) + " ".join(f"{k}={v}" for k, v in (info["environ"] or {}).items())
        if text in blob and info["status"] != psutil.STATUS_ZOMBIE and p.pid != psutil.Process().pid:
            found.append(f"{p.pid}: {blob[:200]}")
    return found


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("demo")
    out = work / "demo.json"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "demo", "--dir", str(work / "d"), "--steps", str(STEPS)]
    argv += ["--json", str(out)]
    done = run(argv, timeout=TIMEOUT_S)
    return {
        "rc": done.returncode,
        "output": done.output,
        "data": json.loads(out.read_text()) if out.exists() else None,
        "dir": work / "d",
    }


def test_the_demo_exits_0_and_says_the_loss_logs_matched_bitwise(demo: dict[str, Any]) -> None:
    assert demo["rc"] == 0, demo["output"][-4000:]
    assert f"all {STEPS} steps bitwise equal (loss_hex)" in demo["output"], demo["output"][-4000:]


def test_each_injected_rank_fault_is_detected_by_its_own_event(demo: dict[str, Any]) -> None:
    faults = demo["data"]["faults"]
    got = [(f["kind"], f.get("detected_by")) for f in faults]
    expected = [("kill-rank", "worker_exited"), ("stop-rank", "heartbeat_timed_out"), ("kill-supervisor", None)]
    assert got == expected, demo["output"][-4000:]


def test_the_restarted_supervisor_adopts_the_journal_and_finds_no_orphan(demo: dict[str, Any]) -> None:
    killed = [f for f in demo["data"]["faults"] if f["kind"] == "kill-supervisor"]
    assert [(f["journal_adopted"], f["orphans"]) for f in killed] == [(True, [])]


def test_every_fault_is_followed_by_a_resumed_step(demo: dict[str, Any]) -> None:
    assert [f.get("recover_s") is not None for f in demo["data"]["faults"]] == [True, True, True]


def test_nothing_of_either_job_is_left_running(demo: dict[str, Any]) -> None:
    assert (demo["data"]["leftover_processes"], processes_mentioning(str(demo["dir"]))) == ([], [])


def test_the_demo_refuses_a_non_empty_directory_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    done = run([sys.executable, "-m", "ftsup.supervisor.cli", "demo", "--dir", str(tmp_path)], timeout=60)
    assert (done.returncode, done.output.strip().splitlines()[-1].startswith("ftsup: error:")) == (2, True)
