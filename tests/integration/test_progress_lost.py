"""What a person at the terminal sees of a relaunch that loses progress: one run of `tests/bin/ddp_beats.py` (plain
DDP on gloo, one `runtime().beat(step)` line per step, never resuming) under `ftsup run`, its rank 1 SIGKILLed past
step 40. The relaunch starts from scratch: `progress_lost` names the steps and the console says what to do; the
cause is the signal, not the warning the rank printed last; the ranks' output is on stdout, prefixed by rank, line
for line as in the attempts' logs."""

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
KILL_PAST = 40


def rank_past(workdir: Path, rank: int, step: int) -> dict[str, Any] | None:
    try:
        seen: dict[str, Any] = json.loads((workdir / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None
    return seen if seen["step"] > step else None


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("lost")
    job = [str(BIN / "ddp_beats.py"), "--dir", str(workdir), "--steps", "80", "--step-s", "0.03"]
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--nproc-per-node", "2", "--logging-format", "console"]
    argv += ["--restart-backoff-initial-s", "0.2", "--", *job]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **ENV)
    with (workdir / "stdout").open("wb") as out, (workdir / "stderr").open("wb") as err:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=err)
    try:
        victim = wait_for(
            lambda: rank_past(workdir, 1, KILL_PAST),
            120,
            lambda: f"rank 1 never got past step {KILL_PAST}: {(workdir / 'stderr').read_text()[-3000:]}",
        )
        assert victim["pid"] in {p.pid for p in procs.descendants([proc.pid])}  # only a process of this run
        os.kill(victim["pid"], signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    [log_dir] = (workdir / ".ftsup").glob("*/logs")
    events = [json.loads(line) for line in (log_dir / "supervisor.jsonl").read_text().splitlines()]
    return {
        "code": code,
        "victim": victim,
        "events": events,
        "stdout": (workdir / "stdout").read_text(),
        "stderr": (workdir / "stderr").read_text(),
        "logs": [(log_dir / f"attempt-000{n}.log").read_text() for n in (1, 2)],
    }


def reported(run: dict[str, Any]) -> int:
    """The highest step attempt 1 reported, as the supervisor's figures say."""
    return max(e["step"] for e in run["events"] if e["event"] == "worker_exited")


def test_the_job_is_relaunched_once_and_finishes(killed_run: dict[str, Any]) -> None:
    launched = [e["attempt"] for e in killed_run["events"] if e["event"] == "workers_launched"]
    assert (killed_run["code"], launched) == (0, [1, 2]), killed_run["stderr"][-3000:]


def test_a_relaunch_of_a_script_that_does_not_resume_logs_progress_lost_naming_the_steps(killed_run) -> None:
    (lost,) = [e for e in killed_run["events"] if e["event"] == "progress_lost"]
    best = reported(killed_run)
    told = (lost["attempt"], lost["step"], lost["resume_step"], lost["best_step"], lost["lost_steps"])
    assert (best > KILL_PAST, told) == (True, (2, 0, None, best, [1, best]))


def test_the_console_says_which_steps_were_lost_and_what_to_do(killed_run: dict[str, Any]) -> None:
    said = f"ftsup: warning: attempt 2 started from scratch: steps 1-{reported(killed_run)}, which earlier attempts "
    todo = "To resume instead, adopt a Session (docs/adopting.md) or save and resume in the script"
    line = next((x for x in killed_run["stderr"].splitlines() if x.startswith(said)), "")
    assert line.endswith(todo), killed_run["stderr"][-3000:]


def test_a_sigkilled_ranks_cause_is_the_signal_never_the_warning_it_printed_last(killed_run) -> None:
    (failed,) = [e for e in killed_run["events"] if e["event"] == "worker_exited"]
    pid = killed_run["victim"]["pid"]
    assert failed["reason"] == f"rank 1 (pid {pid}) was killed by SIGKILL (out of memory, or kill -9)"


def test_the_ranks_output_is_on_stdout_prefixed_by_rank_line_for_line_as_in_the_attempt_logs(killed_run) -> None:
    shown = killed_run["stdout"].splitlines()
    kept = [line for log in killed_run["logs"] for line in log.splitlines()]
    assert ("[rank0]: rank 0 step 10" in shown, "[rank1]: rank 1 step 10" in shown, shown) == (True, True, kept)
