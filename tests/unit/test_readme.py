"""The README's two opening commands are a contract, and .ci/run runs the second verbatim."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALL = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e '.[test]'"
MAIN_JOB = f"{INSTALL} && .venv/bin/ftsup demo"
# The tests also need Debian packages: a real single-node Slurm (tests/integration/test_slurm.py),
# systemd-analyze (tests/integration/test_deploy.py), Prometheus and promtool
# (tests/integration/test_metrics_prometheus.py).
APT = "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge systemd prometheus"
# The suite runs three test modules at a time (pytest-xdist, one module per worker), then the tests marked `alone`
# with nothing beside them.
PYTEST = ".venv/bin/python -m pytest -q"
TESTS = f"{APT} && {INSTALL} && {PYTEST} -n 3 --dist loadfile -m 'not alone' tests && {PYTEST} -m alone tests"

# A title line, then two one-line bash blocks, with nothing but blank lines around them.
OPENING = re.compile(r"\A# [^\n]+\n\s*```bash\n([^\n]+)\n```\n\s*```bash\n([^\n]+)\n```\n")


def readme_commands() -> tuple[str, str]:
    match = OPENING.match((REPO / "README.md").read_text())
    if match is None:
        raise AssertionError("README.md must open with a title and two one-line bash blocks")
    return match.group(1), match.group(2)


def test_readme_opens_with_the_main_job_then_the_test_command() -> None:
    assert readme_commands() == (MAIN_JOB, TESTS)


def test_ci_run_runs_the_readme_test_command_verbatim() -> None:
    _, tests = readme_commands()
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert [line for line in lines if "pytest" in line and not line.startswith("#")] == [tests]


def test_ci_run_is_an_executable_strict_bash_script() -> None:
    path = REPO / ".ci" / "run"
    lines = path.read_text().splitlines()
    assert (os.access(path, os.X_OK), lines[0], "set -euo pipefail" in lines) == (
        True,
        "#!/usr/bin/env bash",
        True,
    )
