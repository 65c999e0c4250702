"""Zero-line supervision: scripts without a line of ftsup under `ftsup run -- ...`, with no YAML file at all.

`tests/bin/plain_ddp.py`, plain torch DDP that checkpoints itself with `torch.save`, is given as a bare script path
and runs under `python` as torchrun would run it; one run with `--no-instrument` (so that the script sends nothing:
test_zero_line_auto.py has it instrumented), whose rank 1 is SIGKILLed at step 5, serves the claims about it, its
startup timeout far shorter than the run, so that `heartbeat.mode: required` would have killed the script for its
silence. `tests/bin/beater.py` beats: under `heartbeat.mode: auto` its SIGSTOPped rank is caught as a
hang. Each run starts in a directory of its own, where the state directory (`.ftsup/<node>`) lands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftsup import procs
from tests.procs import BIN, PYTHONPATH, kill_tree, run, wait_for

pytestmark = pytest.mark.multiprocess

STEPS = 30
KILL_AT = 5  # rank 0 has checkpointed step 4 once rank 1 is past step 5 (DDP keeps the ranks in step)
HANGS = {"startup_timed_out", "heartbeat_timed_out", "progress_timed_out"}
# `python` as the ranks find it on PATH: this interpreter, the one with torch.
ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}
FAST = ["--restart-backoff-initial-s", "0.2", "--restart-stop-grace-s", "3"]


def ftsup(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftsup.supervisor.cli", *args]


def events(workdir: Path) -> list[dict[str, Any]]:
    [log] = (workdir / ".ftsup").glob("*/logs/supervisor.jsonl")
    return [json.loads(line) for line in log.read_text().splitlines()]


def rank_past(workdir: Path, rank: int, step: int) -> dict[str, int] | None:
    """The rank's {"pid", "step"} once it is past `step`, else None."""
    try:
        seen: dict[str, int] = json.loads((workdir / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None
    return seen if seen["step"] > step else None


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`ftsup run` of plain_ddp.py on 2 ranks, no YAML, rank 1 SIGKILLed once it is past step KILL_AT."""
    workdir = tmp_path_factory.mktemp("plain")
    script = [str(BIN / "plain_ddp.py"), "--steps", str(STEPS), "--dir", str(workdir)]
    argv = ftsup("run", "--nproc-per-node", "2", "--no-instrument", "--set", "heartbeat.startup_timeout_s=1", *FAST)
    argv += ["--", *script]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **ENV)
    with (workdir / "ftsup.out").open("w") as out:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        victim = wait_for(
            lambda: rank_past(workdir, 1, KILL_AT),
            120,
            lambda: f"rank 1 never got past step {KILL_AT}: {(workdir / 'ftsup.out').read_text()[-3000:]}",
        )
        assert victim["pid"] in {p.pid for p in procs.descendants([proc.pid])}  # only a process of this run
        os.kill(victim["pid"], signal.SIGKILL)
        code = proc.wait(timeout=180)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    lines = [json.loads(line) for line in (workdir / "loss.jsonl").read_text().splitlines()]
    return {"code": code, "events": events(workdir), "lines": lines, "out": (workdir / "ftsup.out").read_text()}


def test_a_sigkilled_rank_of_a_script_without_ftsup_is_relaunched_and_the_job_finishes(killed_run):
    launched = [e["attempt"] for e in killed_run["events"] if e["event"] == "workers_launched"]
    assert (killed_run["code"], launched, killed_run["lines"][-1]["step"]) == (0, [1, 2], STEPS), killed_run["out"]


def test_the_relaunched_script_resumes_from_its_own_checkpoint(killed_run):
    checkpointed = killed_run["lines"][-1]["first_step"] - 1  # the step its last process loaded
    assert checkpointed in range(KILL_AT - 1, STEPS, 2), killed_run["lines"]  # one it saved (every 2nd), from step 4


def test_a_script_that_sends_no_heartbeats_is_never_killed_for_it(killed_run):
    failures = [e["event"] for e in killed_run["events"] if e.get("level") == "error"]
    assert (HANGS & set(failures), failures.count("worker_exited")) == (set(), 1), failures


def test_in_auto_mode_a_script_that_beats_gets_hang_detection(tmp_path: Path):
    beater = [str(BIN / "beater.py"), "--steps", "40", "--step-s", "0.05", "--stop-at", "10"]
    r = run(
        ftsup("run", "--nproc-per-node", "2", "--heartbeat-mode", "auto", *FAST, "--", "python", *beater),
        cwd=tmp_path,
        env=ENV,
        timeout=180,
    )
    hangs = [e["attempt"] for e in events(tmp_path) if e["event"] == "heartbeat_timed_out"]
    assert (r.returncode, hangs) == (0, [1]), r.output[-4000:]
