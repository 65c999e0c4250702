"""`ftsup bench checkpoint`'s Hugging Face rows, run small for real (the others skipped): the export measured against
a raw write of its bytes with its child's peak RSS, both imports exact with each rank's bytes read over its share,
every target of theirs with a value, nothing left behind.

One module-scoped run (8 MiB of state, 2 ranks, one repeat, shards of 200KB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftsup.tools.bench.checkpoint import hf_report
from ftsup.tools.bench.checkpoint.report import ROW_NAMES

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("bench-hf")
    out = work / "out.json"
    others = [n for n in ROW_NAMES if n not in hf_report.ROW_NAMES]
    argv = [sys.executable, "-m", "ftsup.tools.bench", "checkpoint", "--size-mb", "8", "--ranks", "2", "--repeats", "1"]
    argv += ["--hf-max-shard-size", "200KB", "--dir", str(work / "d"), "--json", str(out), "--skip", *others]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"benchmark ran past {RUN_TIMEOUT_S}s:\n{output[-4000:]}")
    data = json.loads(out.read_text()) if out.exists() else None
    assert data is not None, output[-4000:]
    return {
        "rc": proc.returncode,
        "output": output,
        "data": data,
        "dir": work / "d",
        "rows": {r["name"]: r for r in data["results"]},
    }


def test_the_hf_rows_complete_and_the_others_are_skipped(bench: dict[str, Any]) -> None:
    statuses = {n: r["status"] for n, r in bench["rows"].items()}
    expected = {n: "ok" if n in hf_report.ROW_NAMES else "skipped" for n in ROW_NAMES}
    assert (bench["rc"], statuses) == (0, expected), bench["output"][-4000:]


def test_the_export_is_timed_against_a_raw_write_of_its_bytes_with_its_own_peak_rss(bench: dict[str, Any]) -> None:
    row = bench["rows"]["hf_export"]
    got = {
        f: row[f] is not None and row[f] > 0
        for f in ("gib_per_s", "raw_adjacent_gib_per_s", "bytes", "peak_rss_bytes", "largest_shard_bytes")
    }
    assert (got, row["shards"] > 1, row["largest_shard_bytes"] <= 200_000 + 4096) == (
        dict.fromkeys(got, True),
        True,
        True,
    )


def test_both_imports_are_exact_and_measure_each_ranks_bytes_against_its_share(bench: dict[str, Any]) -> None:
    rows = bench["rows"]
    got = {
        n: (
            rows[n]["exact"],
            rows[n]["load_s"] > 0,
            isinstance(rows[n]["rank_rchar_vs_share"], float),
            isinstance(rows[n]["bytes_read"], int),
        )
        for n in hf_report.IMPORT_ROWS
    }
    assert got == {n: (True, True, True, True) for n in hf_report.IMPORT_ROWS}


def test_ftsups_import_reads_its_share_as_the_loader_counts_it(bench: dict[str, Any]) -> None:
    row = bench["rows"]["hf_import"]
    assert row["engine_bytes_read"] == row["needed_bytes"]


def test_every_hf_target_has_a_value(bench: dict[str, Any]) -> None:
    targets = bench["data"]["targets"]
    assert {n: targets[n]["value"] is not None for n in hf_report.TARGETS} == dict.fromkeys(hf_report.TARGETS, True)


def test_no_process_is_left_and_the_run_folder_is_removed(bench: dict[str, Any]) -> None:
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]
    assert (left, list(bench["dir"].glob("ftsup-bench-*"))) == ([], [])
