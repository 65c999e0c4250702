"""The suite's start-up hook (`tests/site`) is what the processes the tests start run, however they get their
`PYTHONPATH`: from `tests/procs.py`, or inherited from the suite's environment (`tests/conftest.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.procs import SITE, run

WHICH = "import sitecustomize; print(sitecustomize.__file__)"


def test_a_process_started_by_procs_run_runs_the_suites_start_up_hook() -> None:
    done = run([sys.executable, "-c", WHICH], timeout=60)
    assert (done.returncode, done.output.strip()) == (0, str(SITE / "sitecustomize.py"))


def test_a_process_inheriting_the_suites_environment_runs_it_too() -> None:
    out = subprocess.run([sys.executable, "-c", WHICH], env=os.environ, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, str(SITE / "sitecustomize.py"))
