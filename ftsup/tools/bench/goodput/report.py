"""`ftsup bench goodput`'s rows, checks and table: pure, from what `drive` saw and `account` computed."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ftsup.supervisor.policy.goodput import CAUSES
from ftsup.tools.bench.goodput.account import Account
from ftsup.tools.bench.goodput.drive import Run

# torch.distributed's default timeout of a gloo collective (`default_pg_timeout`, 30 min): how long a hang
# lasts where nothing else ends it, and where the benchmark's cap cuts it short.
COLLECTIVE_TIMEOUT_S = 1800.0
TARGET_GOODPUT = 0.85
TARGET_MARGIN_OVER_TORCHRUN = 0.2
SHORT = {
    "startup": "startup",
    "checkpoint_load": "load",
    "checkpoint_save": "save",
    "wasted_progress": "wasted",
    "detection": "detect",
    "backoff": "backoff",
    "eviction": "evict",
    "other": "other",
}


def row(name: str, command: str, run: Run, acc: Account, hang_cap_s: float) -> dict[str, Any]:
    """One contender's result row (the JSON's `results[]`)."""
    capped = sum(1 for f in run.faults if f["capped"])
    # Each capped hang would have lasted until the collective timeout, not hang_cap_s: the wall time it would
    # have added, with the same productive time (and no further faults in it: an estimate that flatters).
    longer = acc.wall_s + capped * max(0.0, COLLECTIVE_TIMEOUT_S - hang_cap_s)
    return {
        "name": name,
        "command": command,
        **acc.to_dict(),
        "goodput_at_collective_timeout": round(acc.productive_s / longer, 4) if capped and longer > 0 else None,
        "completed": run.completed,
        "steps_logged": run.steps_logged,
        "exit_codes": run.exit_codes,
        "launches": run.launches,
        "faults_delivered": len(run.faults),
        "faults_survived": sum(1 for f in run.faults if f["survived"]),
        "capped_hangs": capped,
        "faults_coalesced": sum(len(f["coalesced"]) for f in run.faults),
        **fired(run.faults),
        "ended_by": run.ended_by,
        "orphans": len(run.orphans),
        "orphan_processes": run.orphans,
        "faults": run.faults,
        "not_run": None,
    }


def fired(faults: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The evictions delivered, those whose checkpoint survived the node (the job resumed at or past the step of
    the notice: no step lost), and their ratio, the fired rate (None without an eviction)."""
    evictions = [f for f in faults if f["kind"] == "evict"]
    survived = sum(1 for f in evictions if f.get("fired"))
    rate = round(survived / len(evictions), 4) if evictions else None
    return {"evictions": len(evictions), "evictions_fired": survived, "fired_rate": rate}


def not_run(name: str, command: str, reason: str) -> dict[str, Any]:
    return {"name": name, "command": command, "goodput": None, "not_run": reason}


def checks(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The targets: ftsup's goodput at least 0.85, at least 0.2 above torchrun's, above each ft_launcher row's.
    `pass` is null where a row needed was not run."""
    by = {r["name"]: r.get("goodput") for r in rows}
    ftsup = by.get("ftsup")
    out: dict[str, dict[str, Any]] = {
        "ftsup_goodput": {
            "goodput": ftsup,
            "target": TARGET_GOODPUT,
            "pass": None if ftsup is None else ftsup >= TARGET_GOODPUT,
        },
    }
    torchrun = by.get("torchrun")
    out["ftsup_over_torchrun"] = {
        "margin": None if ftsup is None or torchrun is None else round(ftsup - torchrun, 4),
        "target": TARGET_MARGIN_OVER_TORCHRUN,
        "pass": None if ftsup is None or torchrun is None else ftsup - torchrun >= TARGET_MARGIN_OVER_TORCHRUN,
    }
    for name in ("nvrx-default", "nvrx-tuned"):
        other = by.get(name)
        out[f"ftsup_over_{name.replace('-', '_')}"] = {
            "margin": None if ftsup is None or other is None else round(ftsup - other, 4),
            "pass": None if ftsup is None or other is None else ftsup > other,
        }
    return out


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def table(out: Mapping[str, Any]) -> str:
    """The results as a person reads them: one line per contender, then the schedule, the notes and checks."""
    head = [
        "contender",
        "goodput",
        "productive_s",
        "wall_s",
        *(SHORT[c] for c in CAUSES),
        "faults",
        "capped",
        "ended by",
    ]
    lines = [head]
    for r in out["results"]:
        if r.get("not_run"):
            lines.append([r["name"], "not run", *[""] * (len(head) - 3), r["not_run"]])
            continue
        bad = r["badput_s"]
        ended = "-" if r["ended_by"] is None else _ended(r["ended_by"])
        lines.append(
            [
                r["name"],
                _fmt(r["goodput"]),
                f"{r['productive_s']:.1f}",
                f"{r['wall_s']:.1f}",
                *(f"{bad[c]:.1f}" for c in CAUSES),
                _faults(r),
                str(r["capped_hangs"]),
                ended,
            ]
        )
    widths = [max(len(row[i]) for row in lines if len(row) > i) for i in range(len(head) - 1)]
    text = [
        "",
        *("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() + "  " + row[-1] for row in lines),
    ]
    text.append("")
    for r in out["results"]:
        text.append(f"{r['name']}: {r['command']}")
    sched = out.get("schedule", {})
    text.append(f"faults: {sched.get('description', '-')}")
    text.append("faults: survived/delivered (+N: due while the job was already down, folded into the next)")
    text.append(
        f"hangs capped at {sched.get('hang_cap_s')} s (a gloo collective's timeout is "
        f"{COLLECTIVE_TIMEOUT_S:g} s): badput columns in seconds"
    )
    for r in out["results"]:
        if r.get("goodput_at_collective_timeout") is not None:
            text.append(
                f"  {r['name']}: {r['capped_hangs']} hang(s) capped; waiting out the collective timeout "
                f"instead, its goodput would be about {r['goodput_at_collective_timeout']:.3f}"
            )
    for r in out["results"]:
        if r.get("evictions"):
            text.append(
                f"  {r['name']}: {r['evictions_fired']} of {r['evictions']} eviction(s) fired (the checkpoint "
                f"survived the node, no step lost): fired rate {r['fired_rate']:.2f}"
            )
    text.append("checks:")
    for name, c in out.get("checks", {}).items():
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[c.get("pass")]
        text.append(f"  {name}: {verdict} {json.dumps({k: v for k, v in c.items() if k != 'pass'})}")
    return "\n".join(text)


def _faults(r: Mapping[str, Any]) -> str:
    """Survived/delivered, and +N for the faults due while the job was already down (folded into the next)."""
    merged = r.get("faults_coalesced") or 0
    return f"{r['faults_survived']}/{r['faults_delivered']}" + (f"+{merged}" if merged else "")


def _ended(ended: Mapping[str, Any]) -> str:
    fault = ended.get("fault")
    what = f"fault {fault['index']} ({fault['kind']})" if fault and fault.get("index") is not None else "no fault"
    return f"{ended['reason']} at {ended['t_s']:.0f} s, {what} in flight"
