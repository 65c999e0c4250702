"""`ftsup bench eviction`, small: ftsup loses no step; periodic-only checkpoints do."""

from __future__ import annotations

import json
import sys

import pytest

from tests.procs import run

pytestmark = pytest.mark.multiprocess


def test_eviction_benchmark_reports_zero_lost_steps_for_ftsup(tmp_path):
    out = tmp_path / "bench.json"
    r = run([sys.executable, "-m", "supervisor.bench_eviction", "--evictions", "1", "--dir", str(tmp_path / "w"),
             "--json", str(out)], timeout=300)  # fmt: skip
    assert r.returncode == 0, r.output[-3000:]
    res = {x["name"]: x for x in json.loads(out.read_text())["results"]}
    assert res["ftsup"]["lost_steps_total"] == 0 and res["ftsup"]["rows"][0]["exit"] == 5
    assert res["periodic"]["rows"][0]["lost_steps"] == res["periodic"]["lost_steps_total"] >= 0
    assert "notice_to_commit_s" in res["ftsup"]["rows"][0]
