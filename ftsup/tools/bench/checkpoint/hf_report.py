"""The Hugging Face rows of `ftsup bench checkpoint`: their names, the figures they add and their targets.

Pure (no torch, no I/O), like `report`, which takes these in; the rows are measured by `hf_rows` in a group of
ranks of their own. What each row measures: docs/benchmarks.md, "Hugging Face export and import".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MIB = 2**20

ROW_NAMES = ("hf_export", "hf_import", "dcp_hf_import")
IMPORT_ROWS = ("hf_import", "dcp_hf_import")

# Figures of these rows that `report` combines across ranks by their maximum.
MAX_FIELDS = frozenset(
    {"largest_shard_bytes", "shards", "export_base_rss_bytes", "rank_bytes_read_vs_share", "rank_rchar_vs_share"}
)

TARGETS = {
    "hf_export_throughput_vs_raw_write": (">=", 0.7),
    "hf_export_peak_rss_over_largest_shard_mib": ("<=", 256.0),
    "hf_import_rank_bytes_read_vs_share": ("<=", 1.1),
    "hf_import_rank_rchar_vs_share": ("<=", 1.1),
    "hf_import_time_vs_dcp_hf_import": ("<=", 1.0),
}


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


def ratios(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The figures the targets are stated in, and the peer's for comparison (None where an input is missing)."""

    def get(name: str, field: str) -> Any:
        return rows.get(name, {}).get(field)

    peak, largest = get("hf_export", "peak_rss_bytes"), get("hf_export", "largest_shard_bytes")
    return {
        "hf_export_throughput_vs_raw_write": _ratio(
            get("hf_export", "gib_per_s"), get("hf_export", "raw_adjacent_gib_per_s")
        ),
        "hf_export_peak_rss_over_largest_shard_mib": (
            None if peak is None or largest is None else (peak - largest) / MIB
        ),
        "hf_import_rank_bytes_read_vs_share": get("hf_import", "rank_bytes_read_vs_share"),
        "hf_import_rank_rchar_vs_share": get("hf_import", "rank_rchar_vs_share"),
        "dcp_hf_import_rank_bytes_read_vs_share": get("dcp_hf_import", "rank_bytes_read_vs_share"),
        "hf_import_time_vs_dcp_hf_import": _ratio(get("hf_import", "load_s"), get("dcp_hf_import", "load_s")),
    }
