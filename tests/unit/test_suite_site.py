"""The suite's start-up hook (`tests/site`) is what the processes the tests start run, however they get their
`PYTHONPATH`: from `tests/procs.py`, or inherited from the suite's environment (`tests/conftest.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.cpuprofile import by_kind, kind
from tests.procs import SITE, run

WHICH = "import sitecustomize; print(sitecustomize.__file__)"


def test_a_process_started_by_procs_run_runs_the_suites_start_up_hook() -> None:
    done = run([sys.executable, "-c", WHICH], timeout=60)
    assert (done.returncode, done.output.strip()) == (0, str(SITE / "sitecustomize.py"))


def test_a_process_inheriting_the_suites_environment_runs_it_too() -> None:
    out = subprocess.run([sys.executable, "-c", WHICH], env=os.environ, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, str(SITE / "sitecustomize.py"))


def test_with_a_process_log_asked_for_each_process_appends_its_command_line_and_cpu_even_through_os_exit(
    tmp_path,
) -> None:
    log = tmp_path / "procs.jsonl"
    env = dict(os.environ, FTSUP_TEST_PROC_LOG=str(log))
    finish = "import atexit, os; atexit._run_exitfuncs(); os._exit(0)"  # as `ftsup.warmrun.finish` ends: once
    for code in ("pass", "import os; os._exit(3)", finish):
        subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(d["argv"], d["cpu_s"] >= 0) for d in lines] == [
        (["-c", "pass"], True),
        (["-c", "import os; os._exit(3)"], True),
        (["-c", finish], True),
    ]
    assert [r[0] for r in by_kind(lines)] == ["-c"]


def test_a_process_is_named_by_its_module_and_subcommand_or_its_script() -> None:
    assert [
        kind(["-m", "ftsup.supervisor.cli", "run", "--config", "x"]),
        kind(["-u", "-m", "ftsup.trainer.examples.gpt", "--steps", "4"]),
        kind(["/r/ftsup/warmrun.py", "torch.distributed.run"]),
        kind(["-u", "/r/tests/bin/ddp_beats.py", "--dir", "d"]),
        kind(["-X", "importtime", "-u", "-m", "ftsup.tools.bench"]),
    ] == [
        "-m ftsup.supervisor.cli run",
        "-m ftsup.trainer.examples.gpt",
        "warmrun.py torch.distributed.run",
        "ddp_beats.py",
        "-m ftsup.tools.bench",
    ]
