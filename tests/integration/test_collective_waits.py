"""Collective waits and blame under `ftsup run`: `tests/bin/ddp_beats.py` (plain DDP on gloo, one
`runtime().beat(step)` line per step) whose rank 0 alone evaluates inside `runtime().phase("eval")` while rank 1
waits for it in the next all-reduce is never restarted, with the defaults; a rank 1 SIGSTOPped mid-run is the rank a
hang blames in each of three hangs of `tests/bin/lockstep.py` (ranks that wait for each other every step, without
torch, so that three attempts fit a test). In a DDP job, with rank 0 waiting in the all-reduce: test_hang_evidence.py,
whose SIGSTOPped rank's run holds that claim beside its incident's. Each run starts in a directory of its own, where
the state directory (`.ftsup/<node>`) lands."""

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
from tests.procs import BIN, PYTHONPATH, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}
HANGS = ("heartbeat_timed_out", "progress_timed_out", "startup_timed_out")
# The learned heartbeat timeout's floor for the tests of a stopped rank: 6 s instead of the default 2, so that a rank
# stalled a second or two by another test's processes beside it on two cores is not taken for the hang they make.
FLOOR = ("--set", "heartbeat.min_timeout_s=6")


def start(workdir: Path, *args: str) -> subprocess.Popen[bytes]:
    """`ftsup run --nproc-per-node 2 ARGS` in `workdir`, its output in workdir/ftsup.out."""
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--nproc-per-node", "2", *args]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **ENV)
    with (workdir / "ftsup.out").open("wb") as out:
        return subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)


def events(workdir: Path) -> list[dict[str, Any]]:
    found = list((workdir / ".ftsup").glob("*/logs/supervisor.jsonl"))
    return [json.loads(line) for line in found[0].read_text().splitlines()] if found else []


def output(workdir: Path) -> str:
    return (workdir / "ftsup.out").read_text(errors="replace")[-4000:]


def rank_at(workdir: Path, rank: int, attempt: int, step: int) -> dict[str, Any] | None:
    """The rank's {"pid", "step", "attempt"} once attempt `attempt` of it reached `step`, else None."""
    try:
        seen: dict[str, Any] = json.loads((workdir / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None
    return seen if seen["attempt"] == str(attempt) and seen["step"] >= step else None


def script(workdir: Path, name: str, *args: str) -> list[str]:
    return ["--", str(BIN / name), "--dir", str(workdir), *args]


def stop_rank_1(workdir: Path, proc: subprocess.Popen[bytes], attempt: int) -> None:
    """SIGSTOP rank 1 of attempt `attempt` once it is past step 5, and wait for the hang to be detected."""
    victim = wait_for(
        lambda: rank_at(workdir, 1, attempt, 5),
        90,
        lambda: f"attempt {attempt}'s rank 1 never reached step 5: {output(workdir)}",
    )
    assert victim["pid"] in {p.pid for p in procs.descendants([proc.pid])}  # only a process of this run
    os.kill(victim["pid"], signal.SIGSTOP)
    wait_for(
        lambda: len([e for e in events(workdir) if e["event"] in HANGS]) == attempt,
        60,
        lambda: f"attempt {attempt}'s hang was never detected: {output(workdir)}",
    )


@pytest.mark.alone  # a 2 s heartbeat timeout: another test's processes beside it could stall a rank that long
def test_rank_0_evaluating_alone_for_5s_every_50_steps_is_never_restarted(tmp_path: Path) -> None:
    evaluating = ["--steps", "150", "--step-s", "0.02", "--eval-every", "50", "--eval-s", "5"]
    proc = start(tmp_path, *script(tmp_path, "ddp_beats.py", *evaluating))
    try:
        code = proc.wait(timeout=150)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    names = [e["event"] for e in events(tmp_path)]
    told = (code, names.count("workers_launched"), [n for n in names if n in HANGS], "job_succeeded" in names)
    assert told == (0, 1, [], True), output(tmp_path)


def test_a_sigstopped_rank_1_is_the_rank_blamed_in_each_of_three_hangs(tmp_path: Path) -> None:
    args = ["--set", "restart.max_attempts_without_progress=10", "--restart-backoff-initial-s", "0.2", *FLOOR]
    proc = start(tmp_path, *args, *script(tmp_path, "lockstep.py", "--steps", "100", "--step-s", "0.02"))
    try:
        for attempt in (1, 2, 3):
            stop_rank_1(tmp_path, proc, attempt)
        code = proc.wait(timeout=60)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    hangs = [e for e in events(tmp_path) if e["event"] in HANGS]
    blamed = [(e["event"], e["rank"], e.get("state"), e["reason"].split(",")[0]) for e in hangs]
    assert (code, blamed) == (0, [("heartbeat_timed_out", 1, "T", "rank 1 stopped (SIGSTOP/state T)")] * 3), hangs
