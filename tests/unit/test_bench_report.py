"""ftsup.tools.bench.checkpoint.report: how rank records become benchmark rows (pure, no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from ftsup.tools.bench.checkpoint import report


def _rec(row: str, rank: int, repeat: Any, **fields: Any) -> dict[str, Any]:
    return {"row": row, "rank": rank, "repeat": repeat, **fields}


def _ok(row: str, ranks: int, **fields: Any) -> list[dict[str, Any]]:
    return [_rec(row, r, None, status="ok", **fields) for r in range(ranks)]


def test_a_repeat_takes_the_slowest_rank_and_the_sum_of_bytes() -> None:
    recs = [
        _rec("x", 0, 0, durable_s=1.0, bytes=10),
        _rec("x", 1, 0, durable_s=3.0, bytes=20),
    ]
    got = report.combine(recs)["x"]
    assert (got["durable_s"], got["bytes"]) == (3.0, 30)


def test_repeats_are_reduced_to_their_median() -> None:
    recs = [_rec("x", 0, i, stall_s=s) for i, s in enumerate([5.0, 1.0, 2.0])]
    assert report.combine(recs)["x"]["stall_s"] == 2.0


def test_each_repeats_timings_are_kept_in_order_after_combining_ranks() -> None:
    recs = [
        _rec("x", 0, 1, stall_s=4.0, block_s=0.5, bytes=1),
        _rec("x", 1, 1, stall_s=6.0, block_s=0.25, bytes=1),
        _rec("x", 0, 0, stall_s=2.0, block_s=0.5, bytes=1),
        _rec("x", 0, "warmup", stall_s=9.0),
    ]
    got = report.combine(recs)["x"]
    assert got["per_repeat"] == [{"stall_s": 2.0, "block_s": 0.5}, {"stall_s": 6.0, "block_s": 0.5}]
    assert report.result_row("x", got, "ok")["per_repeat"] == got["per_repeat"]
    assert "per_repeat" not in report.combine([_rec("y", 0, 0, bytes=1)])["y"]


def test_warmup_is_kept_out_of_the_median_and_reported_as_cold() -> None:
    recs = [_rec("x", 0, "warmup", stall_s=9.0), _rec("x", 0, 0, stall_s=1.0)]
    got = report.combine(recs)["x"]
    assert (got["stall_s"], got["cold_stall_s"]) == (1.0, 9.0)


def test_exact_holds_only_if_every_reporting_rank_and_repeat_says_so() -> None:
    recs = [
        _rec("x", 0, 0, exact=True),
        _rec("x", 1, 0, exact=None),
        _rec("x", 0, 1, exact=False),
    ]
    assert report.combine(recs)["x"]["exact"] is False


def test_unknown_bytes_on_one_rank_make_the_sum_unknown_not_smaller() -> None:
    recs = [_rec("x", 0, 0, bytes_read=100), _rec("x", 1, 0, bytes_read=None)]
    assert report.combine(recs)["x"]["bytes_read"] is None


def test_a_row_is_ok_only_when_every_rank_finished_it() -> None:
    combined = report.combine(_ok("x", 1) + [_rec("x", 0, 0, stall_s=1.0)])["x"]
    assert report.row_status(combined, world_size=2, group_status="timeout") == "timeout"


def test_an_error_on_any_rank_is_the_rows_status() -> None:
    recs = _ok("x", 1) + [_rec("x", 1, None, status="error", error="boom")]
    assert report.row_status(report.combine(recs)["x"], 2, "failed") == "error"


def test_a_row_that_did_not_finish_has_null_figures() -> None:
    combined = report.combine([_rec("x", 0, 0, stall_s=1.0, durable_s=2.0, bytes=1)])["x"]
    row = report.result_row("x", combined, "hung")
    assert (row["stall_s"], row["durable_s"], row["gib_per_s"]) == (None, None, None)


def test_save_throughput_is_bytes_over_durable_time() -> None:
    recs = [_rec("x", 0, 0, durable_s=2.0, bytes=4 * report.GIB)] + _ok("x", 1)
    row = report.result_row("x", report.combine(recs)["x"], "ok")
    assert row["gib_per_s"] == 2.0


def test_load_throughput_is_needed_bytes_over_load_time() -> None:
    recs = [_rec("x", 0, 0, load_s=0.5, needed_bytes=report.GIB, bytes_read=3)] + _ok("x", 1)
    row = report.result_row("x", report.combine(recs)["x"], "ok")
    assert row["gib_per_s"] == 2.0


def test_raw_write_reports_the_faster_way_and_both_figures() -> None:
    buffered = {"name": "raw_write.buffered", "status": "ok", "gib_per_s": 0.5, "durable_s": 2.0}
    direct = {"name": "raw_write.direct", "status": "ok", "gib_per_s": 2.0, "durable_s": 0.5}
    row = report.raw_write_row(buffered, direct, rss={})
    assert (row["name"], row["mode"], row["gib_per_s"], row["buffered_gib_per_s"]) == (
        "raw_write",
        "direct",
        2.0,
        0.5,
    )


def test_ratios_are_none_where_a_peer_is_missing() -> None:
    rows: dict[str, dict[str, Any]] = {"ftsup_async": {"stall_s": 0.1}, "dcp_async": {"stall_s": None}}
    assert report.ratios(rows)["ftsup_async_stall_vs_dcp_async"] is None


def test_targets_compare_in_the_stated_direction() -> None:
    got = report.targets({"ftsup_async_stall_vs_dcp_async": 0.2, "ftsup_sync_throughput_vs_raw_write": 0.9})
    assert (
        got["ftsup_async_stall_vs_dcp_async"]["met"],
        got["ftsup_sync_throughput_vs_raw_write"]["met"],
        got["ftsup_rss_growth_mib"]["met"],
    ) == (False, True, None)


def test_extra_step_time_is_measured_against_the_mean_of_unloaded_steps_on_both_sides() -> None:
    from ftsup.tools.bench.checkpoint.probes import StepLog

    # Skewed unloaded steps (median 0.020, mean 0.025) and a drift: slower after the save.
    log = StepLog(before=[0.02, 0.02, 0.035], during=[0.03] * 10, after=[0.02, 0.02, 0.035])
    assert log.baseline_s == pytest.approx(0.025)
    assert log.extra_s == pytest.approx(10 * (0.03 - 0.025))
    # Steps no slower than usual cost nothing, and never a negative amount.
    assert StepLog(before=[0.03], during=[0.02, 0.02], after=[0.03]).extra_s == 0.0
