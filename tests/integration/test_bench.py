"""`ftsup bench checkpoint`, run small for real: every row reported, sane figures, no leftovers.

One module-scoped run (16 MiB of state, 2 ranks, 3 for resharding, one repeat) serves every
claim below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftsup.tools.bench.checkpoint import launch
from ftsup.tools.bench.checkpoint.durable_rows import READ_PAIRS, STALL_ROWS
from ftsup.tools.bench.checkpoint.durable_rows import ROWS as DURABLE_ROWS
from ftsup.tools.bench.checkpoint.report import CORE_FIELDS, ROW_NAMES
from tests.s3fixtures import client
from tests.s3server import SeaweedS3

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 210
FTSUP_ROWS = ("ftsup_async", "ftsup_sync", "ftsup_load_same", "ftsup_load_reshard")
LOAD_ROWS = ("ftsup_load_same", "ftsup_load_reshard", "dcp_load_reshard")


def _descendants(but: int | None = None) -> list[psutil.Process]:
    """This process's live descendants, but the tree of `but` (the module's S3 store, still running)."""
    spared = set()
    if but is not None:
        spared = {but, *(c.pid for c in psutil.Process(but).children(recursive=True))}
    return [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie" and p.pid not in spared]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory, s3_server: SeaweedS3) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("bench")
    out = work / "out.json"
    client(s3_server).create_bucket(Bucket="bench-durable")
    argv = [sys.executable, "-m", "ftsup.tools.bench", "checkpoint", "--size-mb", "16", "--ranks", "2"]
    argv += ["--repeats", "1", "--rss-saves", "3", "--process-timeout-s", "40", "--dir", str(work / "d")]
    argv += ["--json", str(out), "--durable", "s3://bench-durable/runs", "--durable-part-mib", "5"]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        AWS_CONFIG_FILE=str(work / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(work / "none"),
        **s3_server.env(),
    )
    env.pop("AWS_ENDPOINT_URL", None)
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
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
    left = client(s3_server).list_objects_v2(Bucket="bench-durable").get("KeyCount", 0)
    assert s3_server.proc is not None
    return {
        "rc": proc.returncode,
        "output": output,
        "data": data,
        "dir": work / "d",
        "objects_left": left,
        "store_pid": s3_server.proc.pid,
    }


def _rows(bench: dict[str, Any]) -> dict[str, dict[str, Any]]:
    assert bench["data"] is not None, bench["output"][-4000:]
    return {r["name"]: r for r in bench["data"]["results"]}


def test_benchmark_exits_zero(bench: dict[str, Any]) -> None:
    assert bench["rc"] == 0, bench["output"][-4000:]


def test_json_has_one_row_per_name_in_order(bench: dict[str, Any]) -> None:
    assert [r["name"] for r in bench["data"]["results"]] == list(ROW_NAMES)


def test_every_row_has_every_core_field(bench: dict[str, Any]) -> None:
    missing = {n: [f for f in CORE_FIELDS if f not in r] for n, r in _rows(bench).items()}
    assert {n: m for n, m in missing.items() if m} == {}


def test_peer_rows_complete_or_report_a_hang(bench: dict[str, Any]) -> None:
    rows = _rows(bench)
    statuses = {n: rows[n]["status"] for n in ROW_NAMES if n not in FTSUP_ROWS}
    expected = {n: "ok" for n in statuses}
    if statuses["dcp_async_process"] == "hung":  # seen on torch 2.13 CPU: a reported outcome
        expected["dcp_async_process"] = "hung"
    assert statuses == expected


def test_ftsup_rows_complete(bench: dict[str, Any]) -> None:
    rows = _rows(bench)
    assert {n: rows[n]["status"] for n in FTSUP_ROWS} == {n: "ok" for n in FTSUP_ROWS}


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_save_rows_have_positive_times_and_throughput(bench: dict[str, Any]) -> None:
    # Every one of these rows completes (the two tests above): none is left out here.
    rows = _rows(bench)
    names = ("torch_save", "dcp_save", "dcp_async", "ftsup_async", "ftsup_sync")
    got = {n: tuple(_positive(rows[n][f]) for f in ("stall_s", "durable_s", "gib_per_s")) for n in names}
    assert got == {n: (True, True, True) for n in names}


def test_async_rows_block_no_longer_than_they_take_to_be_durable(bench: dict[str, Any]) -> None:
    rows = _rows(bench)
    names = ("dcp_async", "ftsup_async")
    got = {n: _positive(rows[n]["block_s"]) and rows[n]["block_s"] <= rows[n]["durable_s"] for n in names}
    assert got == {n: True for n in names}


def test_loads_are_exact_and_measure_the_bytes_they_read(bench: dict[str, Any]) -> None:
    # bytes_read may be 0 where the page cache cannot be dropped (it then serves DCP's reads).
    rows = _rows(bench)
    got = {
        n: (rows[n]["exact"], _positive(rows[n]["load_s"]), isinstance(rows[n]["bytes_read"], int)) for n in LOAD_ROWS
    }
    assert got == {n: (True, True, True) for n in LOAD_ROWS}


def test_raw_write_and_memcpy_are_measured(bench: dict[str, Any]) -> None:
    rows = _rows(bench)
    assert (rows["raw_write"]["gib_per_s"] > 0, rows["memcpy"]["gib_per_s"] > 0) == (True, True)


def test_rss_growth_is_reported_with_ftsup_async(bench: dict[str, Any]) -> None:
    row = _rows(bench)["ftsup_async"]
    assert (row["rss_saves"], isinstance(row["rss_growth_bytes"], int)) == (3, True)


def test_every_target_has_its_ratio(bench: dict[str, Any]) -> None:
    data = bench["data"]
    assert set(data["targets"]) - set(data["ratios"]) == set()


def test_no_rank_process_is_left_running(bench: dict[str, Any]) -> None:
    groups = bench["data"]["groups"]
    assert {g: v.get("leftover_pids", []) for g, v in groups.items()} == {g: [] for g in groups}
    assert _descendants(but=bench["store_pid"]) == []


def test_durable_rows_upload_and_restore_beside_plain_s3_and_leave_nothing_in_the_bucket(
    bench: dict[str, Any],
) -> None:
    section = bench["data"]["durable"]
    rows = {r["name"]: r for r in section["rows"]}
    assert [(n, rows[n]["status"]) for n in DURABLE_ROWS] == [(n, "ok") for n in DURABLE_ROWS], rows
    assert all(rows[n]["seconds"] > 0 and rows[n]["bytes"] > 0 for n in DURABLE_ROWS)
    assert set(section["ratios"]) == {"durable_upload_vs_plain", "durable_restore_vs_plain", "durable_stall_vs_alone"}
    assert all(v > 0 for v in section["ratios"].values())
    measured = {n: len(rows[n]["seconds_each"]) for n in DURABLE_ROWS}  # one round: the reads READ_PAIRS times
    assert measured == {"durable_upload": 1, "s3_upload": 1, "durable_restore": READ_PAIRS, "s3_ranged_get": READ_PAIRS}
    each = {n: len(section["targets"][n]["each"]) for n in ("durable_upload_vs_plain", "durable_restore_vs_plain")}
    assert each == {"durable_upload_vs_plain": 1, "durable_restore_vs_plain": READ_PAIRS}
    assert bench["objects_left"] == 0


def test_durable_stall_rows_measure_the_save_with_an_upload_running_beside_it_and_without(
    bench: dict[str, Any],
) -> None:
    section = bench["data"]["durable"]
    rows = {r["name"]: r for r in section["rows"]}
    assert [(n, rows[n]["status"]) for n in STALL_ROWS] == [(n, "ok") for n in STALL_ROWS], rows
    got = {
        n: all(rows[n][f] >= 0 for f in ("stall_s", "block_s", "extra_step_s"))
        and rows[n]["durable_s"] > 0
        and rows[n]["block_s"] <= rows[n]["durable_s"]
        and rows[n]["repeats"] == 1
        for n in STALL_ROWS
    }
    assert got == dict.fromkeys(STALL_ROWS, True), rows
    uploading = rows[STALL_ROWS[0]]
    assert (uploading["upload_s"] > 0, uploading["upload_overlapped"] in ("0/1", "1/1")) == (True, True)
    assert 0 <= uploading["upload_cpu_s"] < uploading["durable_s"] * 4, uploading  # the upload's CPU while it saved
    target = section["targets"]["durable_stall_vs_alone"]
    assert (target["target"], target["met"] == (target["value"] <= 1.1)) == ("<= 1.1", True)


def test_run_folder_is_removed(bench: dict[str, Any]) -> None:
    assert list(bench["dir"].glob("ftsup-bench-*")) == []


def test_a_hanging_group_is_killed_with_its_children_at_the_deadline(tmp_path: Path, s3_server: SeaweedS3) -> None:
    # A "rank" that starts a child (like DCP's checkpoint daemon) and then hangs.
    hang = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(600)']); time.sleep(600)"
    )
    start = time.monotonic()
    outcome = launch.run_group(2, [sys.executable, "-c", hang], tmp_path, "hang", timeout_s=2.0)
    assert (outcome.status, outcome.leftover_pids, len(outcome.stopped_pids)) == ("timeout", (), 4)
    assert time.monotonic() - start < 15
    assert _descendants(but=s3_server.proc.pid if s3_server.proc else None) == []


def test_a_failing_rank_fails_the_group_without_waiting_for_the_deadline(tmp_path: Path) -> None:
    code = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '0' else time.sleep(600)"
    start = time.monotonic()
    outcome = launch.run_group(2, [sys.executable, "-c", code], tmp_path, "fail", timeout_s=120, peer_failure_grace_s=1)
    assert (outcome.status, outcome.exits[0].returncode, outcome.leftover_pids) == ("failed", 3, ())
    assert time.monotonic() - start < 15


def test_a_process_mode_run_past_its_timeout_is_reported_hung_and_leaves_nothing(
    tmp_path: Path, s3_server: SeaweedS3
) -> None:
    others = [n for n in ROW_NAMES if n != "dcp_async_process"]
    argv = [sys.executable, "-m", "ftsup.tools.bench", "checkpoint", "--size-mb", "4", "--dir", str(tmp_path / "d")]
    argv += ["--json", str(tmp_path / "out.json"), "--process-timeout-s", "1", "--skip", *others]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    rows = {r["name"]: r for r in json.loads((tmp_path / "out.json").read_text())["results"]}
    row = rows["dcp_async_process"]
    assert (done.returncode, row["status"], row["stall_s"], row["durable_s"]) == (0, "hung", None, None)
    assert {rows[n]["status"] for n in others} == {"skipped"}
    assert _descendants(but=s3_server.proc.pid if s3_server.proc else None) == []
