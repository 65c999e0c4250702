"""`ftsup bench instrument`, run small for real: both kinds of steps and the hook reported, and every beat the hook
sent read by the receiver in its own process. Its figures are the benchmark's to report (docs/benchmarks.md), never a
test's to judge."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.procs import run

ROUNDS, STEPS = 2, 3


def test_the_benchmark_reports_both_kinds_of_step_and_the_hook_and_every_beat_arrives(tmp_path: Path):
    out = tmp_path / "instrument.json"
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "bench", "instrument"]
    r = run([*argv, "--rounds", str(ROUNDS), "--steps", str(STEPS), "--json", str(out)], timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.output[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    steps = ROUNDS * STEPS
    assert {name: row["steps"] for name, row in rows.items()} == {"plain": steps, "instrumented": steps, "hook": steps}
    assert (rows["hook"]["beats_sent"], rows["hook"]["beats_received"]) == (steps, steps)
    assert 0 < rows["hook"]["us_p10"] <= rows["hook"]["us_median"] <= rows["hook"]["us_p90"]
