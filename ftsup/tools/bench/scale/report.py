"""`ftsup bench scale`'s report: pure functions from the per-world-size results to growth, targets and a table.

Torch-free and without I/O. Growth is each operation's exponent k in cost ~ N^k between the smallest and the
largest world size measured (1 is linear). The targets are judged at the largest world size measured; where that
is below `TARGET_RANKS`, at a linear extrapolation from the two largest, marked `extrapolated`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

MIB = 2**20
GIB = 2**30
TARGET_RANKS = 16384

OPS = (
    ("save_plan_first", "dcp_save_plan", "save plan, first save (the compact plan + the engine's layout)"),
    ("save_plan_cached", "dcp_save_plan_cached", "save plan, cached (a later save)"),
    ("commit_metadata", "dcp_commit_metadata", "commit metadata (gather, dcp_metadata.json, manifest)"),
    ("manifest_parse", None, "manifest parse"),
    ("fast_verify", None, "fast verify of the newest checkpoint"),
    ("resume_choice", None, "resume choice (the supervisor's, fast verify included)"),
    ("ckpt_list", None, "ftsup ckpt list"),
    ("refresh_new", None, "supervisor refresh, a new checkpoint"),
    ("refresh_unchanged", None, "supervisor refresh, no new checkpoint"),
    ("load_plan_reshard", "dcp_load_plan_reshard", "resharded load plan, N -> N/2"),
)
LINEAR_EXPONENT = 1.15
"""Growth up to this exponent counts as linear (timing noise on a shared host moves small figures)."""


def growth(results: Sequence[Mapping[str, Any]], op: str) -> float | None:
    """The exponent k of cost ~ N^k between the smallest and the largest world size (None: one world size)."""
    pts = sorted((r["ranks"], r["ops"][op]["median_s"]) for r in results if op in r.get("ops", {}))
    if len(pts) < 2 or pts[0][1] <= 0 or pts[-1][1] <= 0:
        return None
    (n0, t0), (n1, t1) = pts[0], pts[-1]
    return math.log(t1 / t0) / math.log(n1 / n0)


def at_target(results: Sequence[Mapping[str, Any]], op: str, field: str = "median_s") -> tuple[float | None, bool]:
    """(the figure at TARGET_RANKS, whether it is extrapolated): measured there, or linear from the two largest."""
    pts = sorted((r["ranks"], r["ops"][op][field]) for r in results if op in r.get("ops", {}))
    pts = [(n, v) for n, v in pts if v is not None]
    for n, v in pts:
        if n == TARGET_RANKS:
            return v, False
    if not pts:
        return None, False
    if len(pts) == 1:
        return pts[0][1] * TARGET_RANKS / pts[0][0], True
    (n0, v0), (n1, v1) = pts[-2], pts[-1]
    slope = (v1 - v0) / (n1 - n0)
    return max(v1 + slope * (TARGET_RANKS - n1), v1 * TARGET_RANKS / n1 if slope < 0 else 0.0), True


def targets(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def put(name: str, value: float | None, limit: float, extrapolated: bool, unit: str = "s") -> None:
        out[name] = {
            "value": value,
            "limit": limit,
            "unit": unit,
            "extrapolated": extrapolated,
            "met": value is not None and value <= limit,
        }

    cached, e1 = at_target(results, "save_plan_cached")
    commit, e2 = at_target(results, "commit_metadata")
    put(
        "cached_save_plan_and_commit_metadata_s",
        None if cached is None or commit is None else cached + commit,
        1.0,
        e1 or e2,
    )
    choice, e3 = at_target(results, "resume_choice")
    put("resume_choice_with_fast_verify_s", choice, 1.0, e3)
    refresh, e4 = at_target(results, "refresh_unchanged")
    put("refresh_no_new_checkpoint_s", refresh, 0.010, e4)
    worst = max(((growth(results, op) or 0.0, op) for op, _, _ in OPS), default=(0.0, ""))
    out["linear_growth"] = {
        "worst_exponent": worst[0],
        "worst_op": worst[1],
        "limit": LINEAR_EXPONENT,
        "met": worst[0] <= LINEAR_EXPONENT,
    }
    mem = [
        (r["ops"][op].get("peak_rss_increase_bytes") or 0, op, r["ranks"]) for r in results for op in r.get("ops", {})
    ]
    top = max(mem, default=(0, "", 0))
    out["memory_per_op"] = {
        "worst_bytes": top[0],
        "worst_op": top[1],
        "at_ranks": top[2],
        "limit": GIB,
        "met": top[0] <= GIB,
    }
    versus = {}
    for op, peer, _ in OPS:
        if peer is not None:
            mine, _e = at_target(results, op)
            theirs, _e = at_target(results, peer)
            versus[op] = {
                "ftsup_s": mine,
                "dcp_s": theirs,
                "faster": mine is not None and theirs is not None and mine < theirs,
            }
    out["versus_dcp"] = versus
    return out


def table(results: Sequence[Mapping[str, Any]]) -> str:
    """Median (min-max) milliseconds per operation and world size, the DCP peer under its operation, and growth."""
    sizes = sorted(r["ranks"] for r in results)
    by = {r["ranks"]: r for r in results}
    head = f"{'operation':<56}" + "".join(f"{f'N={n}':>24}" for n in sizes) + f"{'growth':>8}"
    lines = [head, "-" * len(head)]
    for op, peer, label in OPS:
        for name, text in ((op, label), (peer, "  DCP: same")) if peer else ((op, label),):
            cells = []
            for n in sizes:
                m = by[n]["ops"].get(name)
                cells.append(f"{_ms(m):>24}" if m else f"{'-':>24}")
            k = growth(results, name)
            lines.append(f"{text:<56}" + "".join(cells) + (f"{k:>8.2f}" if k is not None else f"{'-':>8}"))
    lines.append("")
    largest = [max((o.get("peak_rss_increase_bytes") or 0) for o in by[n]["ops"].values()) for n in sizes]
    lines.append(f"{'peak memory increase (MiB), largest op':<56}" + "".join(f"{b / MIB:>24.0f}" for b in largest))
    lines.append(f"{'manifest.json (KiB)':<56}" + "".join(f"{by[n]['manifest_bytes'] / 1024:>24.0f}" for n in sizes))
    lines.append(
        f"{'dcp_metadata.json (KiB)':<56}" + "".join(f"{by[n]['dcp_metadata_bytes'] / 1024:>24.0f}" for n in sizes)
    )
    lines.append(f"{'saved chunks':<56}" + "".join(f"{by[n]['chunks']:>24}" for n in sizes))
    return "\n".join(lines)


def _ms(m: Mapping[str, Any]) -> str:
    med, lo, hi = m["median_s"] * 1e3, m["min_s"] * 1e3, m["max_s"] * 1e3
    return f"{_fig(med)} ({_fig(lo)}-{_fig(hi)})"


def _fig(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def targets_text(t: Mapping[str, Any]) -> str:
    lines = []
    for name in (
        "cached_save_plan_and_commit_metadata_s",
        "resume_choice_with_fast_verify_s",
        "refresh_no_new_checkpoint_s",
    ):
        v = t[name]
        value = "n/a" if v["value"] is None else f"{v['value'] * 1e3:.1f} ms"
        extra = f" (extrapolated to N={TARGET_RANKS})" if v["extrapolated"] else f" (at N={TARGET_RANKS})"
        lines.append(f"{name}: {value} <= {v['limit'] * 1e3:g} ms{extra}: {'met' if v['met'] else 'NOT met'}")
    g = t["linear_growth"]
    lines.append(
        f"linear growth: worst exponent {g['worst_exponent']:.2f} ({g['worst_op']}) <= {g['limit']}: "
        f"{'met' if g['met'] else 'NOT met'}"
    )
    m = t["memory_per_op"]
    lines.append(
        f"memory: worst {m['worst_bytes'] / MIB:.0f} MiB ({m['worst_op']} at N={m['at_ranks']}) <= 1024 MiB: "
        f"{'met' if m['met'] else 'NOT met'}"
    )
    for op, v in t["versus_dcp"].items():
        lines.append(f"{op} vs DCP: {'faster' if v['faster'] else 'NOT faster'}")
    return "\n".join(lines)
