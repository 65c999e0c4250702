"""`ftsup bench eviction`, small: ftsup loses no step; periodic-only checkpoints do.

One module-scoped run (one eviction per mode) serves both claims.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ftsup.tools.bench.eviction import CKPT_EVERY
from tests.procs import run

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("bench-eviction")
    out = tmp / "bench.json"
    argv = [sys.executable, "-m", "ftsup.tools.bench.eviction", "--evictions", "1", "--dir", str(tmp / "w")]
    r = run([*argv, "--json", str(out)], timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    return {x["name"]: x for x in json.loads(out.read_text())["results"]}


def test_ftsup_saves_the_step_it_was_evicted_at_and_exits_5(results: dict[str, Any]) -> None:
    row = results["ftsup"]["rows"][0]
    assert (results["ftsup"]["lost_steps_total"], row["exit"], "notice_to_commit_s" in row) == (0, 5, True)


def test_periodic_checkpoints_lose_the_steps_since_the_last_periodic_save(results: dict[str, Any]) -> None:
    # The eviction lands 15 steps after the run's first step (seed 0), so between two periodic
    # saves: the rerun resumes from a multiple of CKPT_EVERY below the step reached.
    row = results["periodic"]["rows"][0]
    lost = row["trained_step"] - row["resume_step"]
    assert (row["lost_steps"], row["resume_step"] % CKPT_EVERY, lost > 0) == (lost, 0, True)
