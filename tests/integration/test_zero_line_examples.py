"""The HF Trainer example as it is written without ftsup (`hf_gpt2 --no-ftsup`: no callback, the Trainer resumes from
its own newest `checkpoint-N/`), under `ftsup run --nproc-per-node 2 --no-instrument -- ...` and no YAML file (as it
runs with nothing of ftsup in its processes; test_zero_line_hf.py has it instrumented): a SIGKILLed rank is
relaunched, the job finishes, and nothing is killed for sending no heartbeats, although the startup timeout is far
shorter than the run. A plain script's case is test_zero_line.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftsup.tools.faults import chaos
from tests.procs import PYTHONPATH, kill_tree

pytestmark = pytest.mark.multiprocess

FAILURES = ("worker_exited", "heartbeat_timed_out", "progress_timed_out", "startup_timed_out")
FAST = ["--set", "heartbeat.startup_timeout_s=1", "--restart-backoff-initial-s", "0.2", "--restart-stop-grace-s", "3"]
FAST += ["--no-instrument"]


def supervise_killed(tmp: Path, script: list[str], kill_after: int) -> tuple[int, list[dict[str, Any]]]:
    """`ftsup run` of `script` on 2 ranks in `tmp`, rank 1 SIGKILLed once the loss log is past `kill_after`."""
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--nproc-per-node", "2"]
    argv += ["--job-state-dir", str(tmp / "state"), *FAST, "--", *script]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
    with (tmp / "ftsup.out").open("w") as out:
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        with chaos.LossLogTail(tmp / "loss.jsonl") as tail:
            tail.wait_for_step(kill_after, 240)
            chaos.send(chaos.supervised_ranks(tmp / "state")[1], signal.SIGKILL)
            code = proc.wait(timeout=300)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    events = [json.loads(x) for x in (tmp / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]
    assert code == 0, (tmp / "ftsup.out").read_text()[-3000:]
    return code, events


def failures(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events if e["event"] in FAILURES]


def logged_steps(tmp: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (tmp / "loss.jsonl").read_text().splitlines()]


def test_the_hf_trainer_script_without_its_callback_is_relaunched_from_its_own_checkpoint(tmp_path):
    steps, out = 16, tmp_path / "hf-out"
    script = ["-m", "ftsup.trainer.examples.hf_gpt2", "--no-ftsup", "--steps", str(steps), "--save-every", "4"]
    script += ["--eval-every", "8", "--eval-pad-s", "3", "--output-dir", str(out)]
    script += ["--loss-log", str(tmp_path / "loss.jsonl")]
    _, events = supervise_killed(tmp_path, script, kill_after=6)
    assert failures(events) == ["worker_exited"]
    logged = logged_steps(tmp_path)
    restart = next(i for i in range(1, len(logged)) if logged[i] <= logged[i - 1])
    resumed_from = logged[restart] - 1
    assert resumed_from in (4, 8) and resumed_from < logged[restart - 1]  # the newest checkpoint-N/ it had saved
    assert logged[restart:] == list(range(resumed_from + 1, steps + 1))
