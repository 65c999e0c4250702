"""Turn the ranks' JSON-line records into result rows, target ratios and a table.

Pure functions over plain data (no torch, no I/O): per repeat, figures are combined
across ranks (times: the slowest rank, because a synchronous job waits for it; bytes:
the sum; checks: all must hold), then the median over repeats is taken.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from ftsup.tools.bench.checkpoint import hf_report

GIB = 2**30
MIB = 2**20

ROW_NAMES = (
    "raw_write",
    "memcpy",
    "torch_save",
    "dcp_save",
    "dcp_async",
    "dcp_async_process",
    "ftsup_async",
    "ftsup_sync",
    "ftsup_load_same",
    "ftsup_load_reshard",
    "dcp_load_reshard",
    *hf_report.ROW_NAMES,
)

_MAX = {
    "stall_s",
    "durable_s",
    "load_s",
    "block_s",
    "extra_step_s",
    "copy_s",
    "baseline_step_s",
    "engine_stage_s",
    "engine_durable_s",
    "steps_during",
    "rss_growth_bytes",
    "rss_before",
    "rss_after",
    "wall_s",
    "copy_plain_s",
    "copy_hugepage_s",
    "raw_adjacent_s",
    "peak_rss_bytes",
    "peak_rss_increase_bytes",
    *hf_report.MAX_FIELDS,
}
_SUM = {"bytes", "bytes_read", "rchar", "needed_bytes", "engine_bytes_read", "engine_tensor_bytes"}
_ALL = {"exact", "perturbed", "cache_dropped"}
_PASS = {"rss_saves"}
_FIRST = {"error"}  # text: the first one known

# Timings also listed repeat by repeat (after combining ranks): the spread behind a median.
_PER_REPEAT = ("stall_s", "block_s", "extra_step_s", "durable_s", "load_s", "copy_s")

# Fields every result row has, null when not measured.
CORE_FIELDS = (
    "stall_s",
    "durable_s",
    "gib_per_s",
    "load_s",
    "bytes_read",
    "rchar",
    "exact",
    "peak_rss_bytes",
    "peak_rss_increase_bytes",
)


def _combine_ranks(field: str, values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    if field in _FIRST:
        return known[0] if known else None
    if field in _ALL:
        return all(known) if known else None
    if field in _SUM:
        return sum(values) if values and len(known) == len(values) else None
    if field in _MAX or field in _PASS:
        return max(known) if known else None
    return None


def _median_over_repeats(field: str, values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    if not known:
        return None
    if field in _FIRST:
        return known[0]
    if field in _ALL:
        return all(known)
    return statistics.median(known)


def combine(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row name: medians over numbered repeats, plus status, peak RSS and extras.

    Returns {row: {"repeats": n, <field>: value, "per_repeat": [{<timing>: value}, ...],
    "status_by_rank": {...}, ...}}.
    """
    by_row: dict[str, dict[Any, list[Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        by_row[rec["row"]][rec.get("repeat")].append(rec)
    out: dict[str, dict[str, Any]] = {}
    for row, by_repeat in by_row.items():
        combined: dict[str, Any] = {}
        numbered = sorted(k for k in by_repeat if isinstance(k, int))
        per_repeat = [_combine_records(by_repeat[k]) for k in numbered]
        fields = {f for r in per_repeat for f in r}
        for f in fields:
            combined[f] = _median_over_repeats(f, [r.get(f) for r in per_repeat])
        combined["repeats"] = len(numbered)
        spread = [{f: r[f] for f in _PER_REPEAT if r.get(f) is not None} for r in per_repeat]
        if any(spread):
            combined["per_repeat"] = spread
        if "warmup" in by_repeat:
            warm = _combine_records(by_repeat["warmup"])
            combined["cold_stall_s"] = warm.get("stall_s")
            combined["cold_durable_s"] = warm.get("durable_s")
        if "reference" in by_repeat:
            combined["reference"] = {
                k: v for k, v in by_repeat["reference"][0].items() if k not in ("row", "rank", "repeat")
            }
        finals = by_repeat.get(None, [])
        combined["status_by_rank"] = {r["rank"]: r.get("status") for r in finals}
        errors = [r["error"] for r in finals if r.get("error")]
        if errors:
            combined["error"] = errors[0]
        for src, dst in (("peak_rss", "peak_rss_bytes"), ("rss_increase", "peak_rss_increase_bytes")):
            if combined.get(dst) is not None:
                continue  # measured around each repeat: closer than the whole row's peak
            known = [r[src] for r in finals if r.get(src) is not None]
            combined[dst] = max(known) if known else None
        out[row] = combined
    return out


def _combine_records(recs: list[Mapping[str, Any]]) -> dict[str, Any]:
    fields = {f for r in recs for f in r} - {"row", "rank", "repeat"}
    return {f: _combine_ranks(f, [r.get(f) for r in recs]) for f in fields}


def row_status(combined: Mapping[str, Any] | None, world_size: int, group_status: str) -> str:
    """ "ok" only when every rank finished the row; otherwise why not.

    `group_status` is how the rank group ended ("ok", "failed", "timeout", "hung", or
    "not run" when the group was never started).
    """
    if combined is None:
        return group_status if group_status != "ok" else "missing"
    statuses = list(combined["status_by_rank"].values())
    for bad in ("error", "not available"):
        if bad in statuses:
            return bad
    if len(statuses) == world_size and all(s == "ok" for s in statuses):
        return "ok"
    return group_status if group_status != "ok" else "incomplete"


def _per_s(nbytes: Any, seconds: Any) -> float | None:
    if not nbytes or not seconds:
        return None
    return float(nbytes) / GIB / float(seconds)


def result_row(name: str, combined: Mapping[str, Any] | None, status: str) -> dict[str, Any]:
    """The JSON row: core fields (null when unmeasured or when the row did not finish)."""
    row: dict[str, Any] = {"name": name, "status": status}
    row.update({f: None for f in CORE_FIELDS})
    if combined is None:
        return row
    if combined.get("error"):
        row["error"] = combined["error"]
    row["completed_repeats"] = combined.get("repeats", 0)
    if status != "ok":
        return row
    skip = {"status_by_rank", "repeats", "error"}
    row.update({k: v for k, v in combined.items() if k not in skip})
    if row.get("load_s") is not None:
        row["gib_per_s"] = _per_s(row.get("needed_bytes"), row["load_s"])
    elif row.get("durable_s") is not None:
        row["gib_per_s"] = _per_s(row.get("bytes"), row["durable_s"])
    elif row.get("copy_s") is not None:
        row["gib_per_s"] = _per_s(row.get("bytes"), row["copy_s"])
    if row.get("raw_adjacent_s") is not None:
        row["raw_adjacent_gib_per_s"] = _per_s(row.get("bytes"), row["raw_adjacent_s"])
    return row


def raw_write_row(buffered: dict[str, Any], direct: dict[str, Any], rss: Mapping[str, Any]) -> dict[str, Any]:
    """The faster of the two ways of writing, with both figures kept."""
    candidates = [r for r in (buffered, direct) if r.get("gib_per_s")]
    best = max(candidates, key=lambda r: r["gib_per_s"]) if candidates else buffered
    row = dict(best, name="raw_write", mode=best.get("name", "").rpartition(".")[2] or None)
    if not candidates:
        row["status"] = buffered["status"]
    row["buffered_gib_per_s"] = buffered.get("gib_per_s")
    row["direct_gib_per_s"] = direct.get("gib_per_s")
    row["direct_error"] = direct.get("error")
    row["peak_rss_bytes"] = rss.get("peak_rss_bytes")
    row["peak_rss_increase_bytes"] = rss.get("peak_rss_increase_bytes")
    return row


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


# ratio name: (comparison, limit): the engine's performance targets, which `ftsup bench checkpoint`
# checks and reports. bytes_read comes from /proc/self/io, where ranks on one host share the page
# cache: a byte two ranks read counts once. rchar (logical bytes read, cache hits included) is the
# stricter reading of the same target, so it is checked as well.
TARGETS = {
    "ftsup_async_stall_vs_dcp_async": ("<=", 0.15),
    "ftsup_async_stall_vs_dcp_async_process": ("<=", 0.5),
    "ftsup_async_block_vs_memcpy": ("<=", 2.0),
    "ftsup_async_throughput_vs_raw_write": (">=", 0.8),
    "ftsup_sync_throughput_vs_raw_write": (">=", 0.8),
    "ftsup_load_reshard_bytes_read_vs_needed": ("<=", 1.1),
    "ftsup_load_reshard_rchar_vs_needed": ("<=", 1.1),
    "ftsup_load_reshard_time_vs_dcp_load_reshard": ("<=", 1.0),
    "ftsup_rss_growth_mib": ("<=", 64.0),
    **hf_report.TARGETS,
}


def ratios(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The figures the targets are stated in (None where an input is missing)."""

    def get(name: str, field: str) -> Any:
        return rows.get(name, {}).get(field)

    growth = get("ftsup_async", "rss_growth_bytes")
    return {
        "ftsup_async_stall_vs_dcp_async": _ratio(get("ftsup_async", "stall_s"), get("dcp_async", "stall_s")),
        "ftsup_async_stall_vs_dcp_async_process": _ratio(
            get("ftsup_async", "stall_s"), get("dcp_async_process", "stall_s")
        ),
        "ftsup_async_block_vs_memcpy": _ratio(get("ftsup_async", "block_s"), get("memcpy", "copy_s")),
        "ftsup_async_throughput_vs_raw_write": _ratio(get("ftsup_async", "gib_per_s"), get("raw_write", "gib_per_s")),
        "ftsup_sync_throughput_vs_raw_write": _ratio(get("ftsup_sync", "gib_per_s"), get("raw_write", "gib_per_s")),
        # The disk's speed drifts over minutes: the same raw write, run just before each
        # ftsup save, is the fairer yardstick (informational; the target uses raw_write).
        "ftsup_async_throughput_vs_adjacent_raw_write": _ratio(
            get("ftsup_async", "gib_per_s"), get("ftsup_async", "raw_adjacent_gib_per_s")
        ),
        "ftsup_sync_throughput_vs_adjacent_raw_write": _ratio(
            get("ftsup_sync", "gib_per_s"), get("ftsup_sync", "raw_adjacent_gib_per_s")
        ),
        "ftsup_load_reshard_bytes_read_vs_needed": _ratio(
            get("ftsup_load_reshard", "bytes_read"), get("ftsup_load_reshard", "needed_bytes")
        ),
        "ftsup_load_reshard_rchar_vs_needed": _ratio(
            get("ftsup_load_reshard", "rchar"), get("ftsup_load_reshard", "needed_bytes")
        ),
        "dcp_load_reshard_rchar_vs_needed": _ratio(
            get("dcp_load_reshard", "rchar"), get("dcp_load_reshard", "needed_bytes")
        ),
        "ftsup_load_reshard_time_vs_dcp_load_reshard": _ratio(
            get("ftsup_load_reshard", "load_s"), get("dcp_load_reshard", "load_s")
        ),
        "ftsup_rss_growth_mib": None if growth is None else growth / MIB,
        **hf_report.ratios(rows),
    }


def targets(values: Mapping[str, float | None]) -> dict[str, dict[str, Any]]:
    """Each target with its value and whether it is met (None: not measured)."""
    out = {}
    for name, (op, limit) in TARGETS.items():
        value = values.get(name)
        met = None if value is None else (value <= limit if op == "<=" else value >= limit)
        out[name] = {"value": value, "target": f"{op} {limit:g}", "met": met}
    return out


def _fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{float(value) / scale:.{digits}f}"


def table(results: list[Mapping[str, Any]], target_rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A fixed-width text table of the rows, then the targets."""
    head = (
        f"{'name':<20} {'status':<14} {'stall_s':>8} {'durable_s':>9} {'GiB/s':>7} "
        f"{'load_s':>7} {'read_MiB':>9} {'exact':>5} {'RSS_MiB':>7} {'+RSS_MiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r['name']:<20} {str(r['status'])[:14]:<14} {_fmt(r['stall_s']):>8} "
            f"{_fmt(r['durable_s']):>9} {_fmt(r['gib_per_s'], digits=2):>7} "
            f"{_fmt(r['load_s']):>7} {_fmt(r['bytes_read'], MIB, 1):>9} "
            f"{_fmt(r['exact']):>5} {_fmt(r['peak_rss_bytes'], MIB, 0):>7} "
            f"{_fmt(r['peak_rss_increase_bytes'], MIB, 0):>8}"
        )
    lines.append("")
    lines.append(f"{'target':<46} {'value':>8} {'goal':>8} {'met':>4}")
    for name, t in target_rows.items():
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"{name:<46} {_fmt(t['value']):>8} {t['target']:>8} {met:>4}")
    return "\n".join(lines)
