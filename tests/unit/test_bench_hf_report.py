"""ftsup.tools.bench.checkpoint.hf_report: the Hugging Face rows' figures and targets (pure, no processes)."""

from __future__ import annotations

from typing import Any

from ftsup.tools.bench.checkpoint import hf_report, report

MIB = 2**20


def _rec(row: str, rank: int, repeat: Any, **fields: Any) -> dict[str, Any]:
    return {"row": row, "rank": rank, "repeat": repeat, **fields}


def test_a_ranks_bytes_over_its_share_is_the_largest_over_the_ranks() -> None:
    recs = [
        _rec("hf_import", 0, 0, rank_bytes_read_vs_share=1.0, rank_rchar_vs_share=1.01),
        _rec("hf_import", 1, 0, rank_bytes_read_vs_share=1.07, rank_rchar_vs_share=1.0),
    ]
    got = report.combine(recs)["hf_import"]
    assert (got["rank_bytes_read_vs_share"], got["rank_rchar_vs_share"]) == (1.07, 1.01)


def test_the_export_is_measured_against_the_raw_write_beside_it_and_its_largest_shard() -> None:
    rows = {
        "hf_export": {
            "gib_per_s": 0.75,
            "raw_adjacent_gib_per_s": 1.0,
            "peak_rss_bytes": 400 * MIB,
            "largest_shard_bytes": 100 * MIB,
        }
    }
    got = hf_report.ratios(rows)
    figures = (got["hf_export_throughput_vs_raw_write"], got["hf_export_peak_rss_over_largest_shard_mib"])
    assert figures == (0.75, 300.0)


def test_the_import_is_timed_against_torchs_reader_and_a_missing_peer_leaves_it_unknown() -> None:
    rows = {"hf_import": {"load_s": 1.0}, "dcp_hf_import": {"load_s": 2.0}}
    alone = {"hf_import": {"load_s": 1.0}}
    got = (
        hf_report.ratios(rows)["hf_import_time_vs_dcp_hf_import"],
        hf_report.ratios(alone)["hf_import_time_vs_dcp_hf_import"],
    )
    assert got == (0.5, None)


def test_every_hf_target_is_one_of_the_benchmarks_and_has_its_ratio() -> None:
    values = report.ratios({})
    assert ({n: report.TARGETS[n] for n in hf_report.TARGETS}, set(hf_report.TARGETS) <= set(values)) == (
        hf_report.TARGETS,
        True,
    )
