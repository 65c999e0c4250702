"""The GPU check's table: the stages and rows measured so far as markdown (`table.md`) and JSON (`results.json`),
rendered again by each call (`meta OUT KEY=VALUE...`, `stage OUT NAME STATUS SECONDS [NOTE]`, `render OUT`), so a run
stopped at any point leaves a table of what it had. Standard library only: it runs before ftsup is installed."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SAVE_ROWS = ("ftsup_async", "dcp_async", "torch_save")
ROW_ORDER = ("raw_write", "ftsup_async", "dcp_async", "torch_save", "ftsup_resume", "dcp_resume")
TARGET_SIZE = "12GB"
BLOCK_TARGET_MS = 10.0
STALL_TARGET_RATIO = 0.5


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; a line cut short by a kill is left out."""
    out = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> dict[str, float] | None:
    """Median, min and max of `values` times `scale`; None for no values."""
    if not values:
        return None
    v = sorted(x * scale for x in values)
    return {"median": round(statistics.median(v), digits), "min": round(v[0], digits), "max": round(v[-1], digits)}


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, name): medians with min and max over the measured repeats (a save's first, which makes
    its buffers, apart)."""
    sizes = list(dict.fromkeys(r["size"] for r in records if "size" in r))
    setup = {r["size"]: r for r in records if r.get("kind") == "info" and r.get("name") == "setup"}
    rows = []
    for size in sizes:
        mine = [r for r in records if r.get("size") == size]
        raw = [r["gb_per_s"] for r in mine if r.get("kind") == "row" and r["name"] == "raw_write"]
        raw_median = statistics.median(raw) if raw else None
        for name in ROW_ORDER:
            measured = [r for r in mine if r.get("kind") == "row" and r["name"] == name and r.get("repeat") != "first"]
            first = [r for r in mine if r.get("kind") == "row" and r["name"] == name and r.get("repeat") == "first"]
            problems = [r for r in mine if r.get("kind") in ("error", "skipped") and r["name"] == name]
            if not measured and not first and not problems:
                continue
            gbs = [r["gb_per_s"] for r in measured if r.get("gb_per_s")]
            row: dict[str, Any] = {
                "size": size,
                "name": name,
                "device": (mine[0].get("device") if mine else None),
                "state_gb": round(setup[size]["state_bytes"] / 1e9, 3) if size in setup else None,
                "n": len(measured),
                "block_ms": spread([r["block_s"] for r in measured if "block_s" in r], 1e3, 2),
                "state_dict_ms": spread([r["state_dict_s"] for r in measured if "state_dict_s" in r], 1e3, 2),
                "stall_ms": spread([r["stall_s"] for r in measured if "stall_s" in r], 1e3, 1),
                "stall_first_ms": spread(
                    [r["stall_first_s"] for r in measured if r.get("stall_first_s") is not None], 1e3, 1
                ),
                "gb_per_s": spread(gbs, 1.0, 2),
                "of_raw_write": round(statistics.median(gbs) / raw_median, 2) if gbs and raw_median else None,
                "load_s": spread([r["load_s"] for r in measured if "load_s" in r], 1.0, 2),
                "exact": all(r["exact"] for r in measured) if any("exact" in r for r in measured) else None,
                "first_block_ms": round(first[0]["block_s"] * 1e3, 1) if first else None,
                "problems": [f"{r['kind']}: {r.get('reason', '')}" for r in problems],
            }
            rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets at 12 GB on the GPU, each met, missed, or not measured (and why)."""
    at = {r["name"]: r for r in rows if r["size"] == TARGET_SIZE and r["device"] == "cuda"}
    ours, dcp = at.get("ftsup_async"), at.get("dcp_async")
    out: dict[str, Any] = {}
    if ours is None or ours["block_ms"] is None:
        out["blocked_ms"] = {"status": "not measured", "why": "no ftsup save on a GPU at 12 GB"}
    else:
        value = ours["block_ms"]["median"]
        out["blocked_ms"] = {"value": value, "target": BLOCK_TARGET_MS, "status": _met(value <= BLOCK_TARGET_MS)}
    if ours is None or dcp is None or not ours["stall_ms"] or not dcp["stall_ms"]:
        out["stall_ratio"] = {"status": "not measured", "why": "ftsup's and DCP's rows at 12 GB on a GPU are needed"}
    else:
        a, b = ours["stall_ms"]["median"], dcp["stall_ms"]["median"]
        ratio = round(a / b, 3) if b > 0 else None
        met = ratio is not None and ratio <= STALL_TARGET_RATIO
        out["stall_ratio"] = {
            "ftsup_ms": a,
            "dcp_ms": b,
            "value": ratio,
            "target": STALL_TARGET_RATIO,
            "status": _met(met),
        }
    exact = [r["exact"] for r in rows if r["name"] == "ftsup_resume" and r["device"] == "cuda"]
    exact = [e for e in exact if e is not None]
    out["resume_exact"] = {"status": _met(all(exact)) if exact else "not measured"}
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _cell(s: dict[str, float] | None) -> str:
    if s is None:
        return ""
    return f"{s['median']:g} ({s['min']:g}-{s['max']:g})" if s["min"] != s["max"] else f"{s['median']:g}"


def _opt(value: Any) -> str:
    return "" if value is None else str(value)


HEADER = (
    "| state | row | device | GB | blocked ms | stall ms | stall, first 3 steps ms | GB/s | of raw write "
    "| resume s | exact | first save blocked ms | n |"
)


def _row_line(r: dict[str, Any]) -> str:
    exact = "" if r["exact"] is None else ("yes" if r["exact"] else "NO")
    note = "; ".join(r["problems"])
    n = f"{r['n']} ({note})" if note else str(r["n"])
    cells = [
        r["size"],
        r["name"],
        r["device"],
        _opt(r["state_gb"]),
        _cell(r["block_ms"]),
        _cell(r["stall_ms"]),
        _cell(r["stall_first_ms"]),
        _cell(r["gb_per_s"]),
        _opt(r["of_raw_write"]),
        _cell(r["load_s"]),
        exact,
        _opt(r["first_block_ms"]),
        n,
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(
    meta: dict[str, Any],
    stages: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    tgt: dict[str, Any],
    infos: list[dict[str, Any]],
) -> str:
    """The table anyone can paste into docs/gpu.md: the run's facts, its stages, its rows, the targets."""
    lines = [f"### GPU check: {meta.get('gpu') or 'no GPU'} ({meta.get('mode', '?')}), {meta.get('date', '?')}", ""]
    facts = [f"{k}: {v}" for k, v in meta.items() if k not in ("gpu", "mode", "date")]
    for i in infos:
        if i.get("name") == "setup":
            where = f"{i.get('ckpt_dir')} ({i.get('fs')})"
            facts.append(f"torch {i.get('torch')}, checksums {i.get('checksums')}, checkpoints in {where}")
            break
    facts += [f"DCP: {i['staging']}" for i in infos if i.get("name") == "dcp_async" and i.get("staging")][:1]
    lines += [f"- {f}" for f in facts] + ["", "| stage | status | s | note |", "|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['status']} | {s.get('seconds', '')} | {s.get('note', '')} |" for s in stages]
    lines += ["", HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [_row_line(r) for r in rows]
    b, st, ex = tgt["blocked_ms"], tgt["stall_ratio"], tgt["resume_exact"]
    blocked = f"{b['value']:g} ms" if "value" in b else b.get("why", "")
    stall = f"{st['ftsup_ms']:g} / {st['dcp_ms']:g} ms = {st['value']}" if "ftsup_ms" in st else st.get("why", "")
    lines += [
        "",
        "Targets at 12 GB per rank:",
        f"- blocked time per save <= {BLOCK_TARGET_MS:g} ms: {b['status']} ({blocked})",
        f"- stall <= {STALL_TARGET_RATIO:g} x DCP's async_save with pinned staging: {st['status']} ({stall})",
        f"- resume bitwise on CUDA: {ex['status']}",
    ]
    return "\n".join(lines) + "\n"


def render(out: Path) -> None:
    stages_raw = read_lines(out / "stages.jsonl")
    meta: dict[str, Any] = {}
    for m in stages_raw:
        if "meta" in m and isinstance(m["meta"], dict):
            meta.update(m["meta"])
    stages = [s for s in stages_raw if "stage" in s]
    records = read_lines(out / "rows.jsonl")
    rows = aggregate(records)
    infos = [r for r in records if r.get("kind") == "info"]
    tgt = targets(rows)
    result = {"meta": meta, "stages": stages, "rows": rows, "targets": tgt, "records": records}
    for name, text in (
        ("results.json", json.dumps(result, indent=1)),
        ("table.md", markdown(meta, stages, rows, tgt, infos)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("meta", "stage", "render"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if argv[0] == "meta":
        pairs = dict(a.split("=", 1) for a in argv[2:] if "=" in a)
        with open(out / "stages.jsonl", "a") as f:
            f.write(json.dumps({"meta": pairs}) + "\n")
    elif argv[0] == "stage":
        if len(argv) < 5:
            print(__doc__, file=sys.stderr)
            return 2
        name, status, seconds = argv[2], argv[3], argv[4]
        note = " ".join(argv[5:]).replace("|", "/").replace("\n", " ")[:300]
        entry = {"stage": name, "status": status, "seconds": seconds, "note": note, "at": round(time.time(), 1)}
        with open(out / "stages.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
    render(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
