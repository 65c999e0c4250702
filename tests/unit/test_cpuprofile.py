"""The suite's CPU profile (`tests/cpuprofile.py`): a test's children's CPU counts in its line, and the summary sums
by module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cpuprofile import by_module
from tests.procs import REPO

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"


def test_a_child_s_cpu_counts_in_its_test_and_the_summary_sums_by_module(tmp_path: Path) -> None:
    (tmp_path / "test_spin.py").write_text(
        "import subprocess, sys\n\n"
        f"def test_child():\n    subprocess.run([sys.executable, '-c', {SPIN!r}], check=True)\n\n"
        "def test_idle():\n    pass\n"
    )
    log = tmp_path / "cpu.jsonl"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "tests.cpuprofile",
        "--cpu-log",
        str(log),
        "-p",
        "no:cacheprovider",
    ]
    done = subprocess.run(
        [*argv, "--rootdir", str(tmp_path), str(tmp_path / "test_spin.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(t) for t in log.read_text().splitlines()]
    children = {line["id"].split("::")[1]: line["children_s"] for line in lines}
    assert (children["test_child"] >= 0.3, children["test_idle"] < 0.05) == (True, True), lines
    [(module, cpu, _wall, count)] = by_module(lines)
    assert (module.endswith("test_spin.py"), cpu >= 0.3, count) == (True, True, 2)
