"""`ftsup bench forensics`, run small for real: two gloo ranks under torchrun, rank 1 stopped while rank 0 waits in
the all-reduce, one capture per choice of stack tools; every row names rank 1, and nothing of the job is left. Its
figures are the benchmark's to report (docs/benchmarks.md), never a test's to judge."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from tests.procs import run

pytestmark = pytest.mark.multiprocess


def test_one_capture_per_row_names_the_stopped_rank_and_the_ranks_are_gone(tmp_path: Path):
    out = tmp_path / "forensics.json"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "bench", "forensics", "--ranks", "2", "--rounds", "1"]
    r = run([*argv, "--timeout-s", "1", "--json", str(out)], timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.output[-3000:]
    got = json.loads(out.read_text())
    rows = {row["name"]: (row["captures"], row["culprits"]) for row in got["results"]}
    named = ["1: stopped (SIGSTOP/state T)"]
    assert rows == {name: (1, named) for name in ("pystack+py-spy", "pystack", "py-spy", "proc")}, got
    assert (got["results"][0]["stacks_min"], got["results"][-1]["stacks_by"]) == (2, {"none": 2}), got
    ranks = [p for p in psutil.process_iter(["cmdline"]) if "forensics.hungrank" in " ".join(p.info["cmdline"] or ())]
    assert [p.pid for p in ranks] == []
