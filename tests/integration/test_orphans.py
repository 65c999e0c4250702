"""No process of an attempt outlives a SIGKILL of the supervisor or of torchrun, at any moment.

Each test starts `ftsup run` on the reference trainer (2 ranks, CPU), waits for one moment of the attempt's life,
SIGKILLs the supervisor or torchrun, and scans /proc for the attempt's mark (`FTSUP_RUN_ID` + `FTSUP_ATTEMPT`,
which every process of the attempt inherits): nothing may be left. The moments are deterministic: torchrun
importing torch before any rank; both ranks held at interpreter start-up, or just after `import torch`, before
their training command runs (`tests/bin/held_rank/sitecustomize.py`); a step in the loss log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from ftsup import procs
from tests.procs import PYTHONPATH, REPO, wait_for

pytestmark = pytest.mark.multiprocess

GONE_WITHIN_S = 20.0  # the parent-death signal acts at once; the rest is slack for a loaded machine
CASES = [
    ("supervisor", "torchrun_starting"),
    ("supervisor", "rank_starting"),
    ("supervisor", "rank_imported_torch"),
    ("supervisor", "rank_training"),
    ("torchrun", "rank_starting"),
    ("torchrun", "rank_imported_torch"),
    ("torchrun", "rank_training"),
]
HOLD = {"rank_starting": "start", "rank_imported_torch": "torch"}
HELD_RANK = REPO / "tests" / "bin" / "held_rank"


def write_job(tmp: Path, run_id: str, hold: str | None = None) -> Path:
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", "--steps", "2000", "--ckpt-every", "1000"]
    command += ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]
    command += ["--min-step-s", "0.05", "--loss-log", str(tmp / "loss.jsonl")]
    cfg: dict[str, Any] = {
        "job": {
            "command": command,
            "workdir": str(tmp),
            "state_dir": str(tmp / "state"),
            "run_id": run_id,
            "env": {"PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
        },
        "launch": {"nproc_per_node": 2},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
    }
    if hold is not None:  # ranks wait at start-up (after importing torch, for "torch") until released
        (tmp / "held").mkdir()
        cfg["job"]["env"].update(
            PYTHONPATH=f"{HELD_RANK}{os.pathsep}{REPO}", FTSUP_TEST_HOLD=str(tmp / "held"), FTSUP_TEST_HOLD_AFTER=hold
        )
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def attempt_processes(run_id: str, attempt: int | None = None) -> list[psutil.Process]:
    """Live processes carrying the run's marker (and the attempt's, when given) in their environment."""
    found = []
    for p in psutil.process_iter(["environ", "status"], ad_value=None):
        env = p.info["environ"] or {}
        if p.info["status"] == psutil.STATUS_ZOMBIE or env.get("FTSUP_RUN_ID") != run_id:
            continue
        if attempt is None or env.get("FTSUP_ATTEMPT") == str(attempt):
            found.append(p)
    return found


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} ppid={p.ppid()} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def torchrun_of(state: Path) -> psutil.Process | None:
    try:
        pids = json.loads((state / "journal.json").read_text())["pids"]
    except (FileNotFoundError, ValueError, KeyError):
        return None
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if "torch.distributed.run" in p.cmdline():
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def ranks(agent: psutil.Process) -> list[psutil.Process]:
    try:
        return agent.children()
    except psutil.NoSuchProcess:
        return []


def wait_for_moment(moment: str, tmp: Path) -> psutil.Process:
    """Poll until `moment` holds; return torchrun."""
    agent = wait_for(lambda: torchrun_of(tmp / "state"), 60, "torchrun did not start", poll_s=0.002)
    if moment == "torchrun_starting":
        assert ranks(agent) == [], "torchrun had started its ranks already"
    elif moment in HOLD:
        wait_for(lambda: len(list((tmp / "held").glob("*.held"))) == 2, 120, "the ranks were not held")
        assert not (tmp / "loss.jsonl").exists()
    else:
        wait_for(lambda: (tmp / "loss.jsonl").exists() and (tmp / "loss.jsonl").read_text(), 120, "no training step")
    return agent


@pytest.mark.parametrize(("target", "moment"), CASES, ids=[f"{t}-{m}" for t, m in CASES])
def test_sigkill_leaves_no_process_of_the_attempt(tmp_path: Path, target: str, moment: str) -> None:
    run_id = f"orphans-{uuid.uuid4().hex[:8]}"
    job = write_job(tmp_path, run_id, HOLD.get(moment))
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
    sup = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        agent = wait_for_moment(moment, tmp_path)
        (sup if target == "supervisor" else agent).send_signal(signal.SIGKILL)
        wait_for(
            lambda: not attempt_processes(run_id, 1),
            GONE_WITHIN_S,
            lambda: f"left after {GONE_WITHIN_S:g} s: {describe(attempt_processes(run_id, 1))}",
        )
        if target == "torchrun":  # the supervisor lives on, relaunches, and stops cleanly on SIGINT
            assert sup.poll() is None
            sup.send_signal(signal.SIGINT)
            assert sup.wait(timeout=60) == 6
    finally:
        sup.kill()
        sup.wait(timeout=10)
        procs.stop(lambda: attempt_processes(run_id), 0)  # cleanup after a failure; a no-op otherwise
    assert attempt_processes(run_id) == []
