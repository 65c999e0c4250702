"""`ftsup bench recovery`: from a fault to the first resumed training step, ftsup against plain torchrun.

`ftsup` runs the supervised job and checks its targets, `torchrun` the plain peer, `common` aims the faults and
makes the rows; the job and the faults are `faults.refjob`'s and `faults.chaos`'s. What each column measures:
docs/benchmarks.md, "Recovery from a fault". Never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ftsup.supervisor.errors import UsageError
from ftsup.tools.bench import shared
from ftsup.tools.bench.recovery.common import load_average
from ftsup.tools.bench.recovery.ftsup import bench_ftsup, slow_save_check
from ftsup.tools.bench.recovery.torchrun import bench_torchrun

PEERS = ("ftsup", "torchrun")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The description and flags of `ftsup bench recovery`."""
    p.description = (
        "Inject SIGKILL and SIGSTOP into the reference trainer's ranks under ftsup run and under plain torchrun; "
        "report detection and recovery times, lost steps and orphans (see ftsup/tools/bench/recovery/). Runs torch "
        "only in subprocesses."
    )
    shared.add_output(p)
    p.add_argument("--repeats", type=shared.positive, default=3, help="kill faults measured (median), default 3")
    p.add_argument("--hang-repeats", type=shared.positive, default=1, help="hang faults measured, default 1")
    p.add_argument(
        "--cycles",
        type=shared.positive,
        default=20,
        help="fault cycles in ftsup's job before the orphan count (kills fill up), default 20",
    )
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated: ftsup, torchrun")
    p.add_argument(
        "--hang-wait-s",
        type=float,
        default=60.0,
        help="how long to wait for torchrun to recover from a fault, default 60",
    )
    p.add_argument("--min-step-s", type=float, default=0.1, help="the trainer's minimum step time, default 0.1")


def run(args: argparse.Namespace) -> int:
    """Exit 0 when ftsup recovered from every fault, finished the job and left no orphan (the
    timing targets are reported under "checks" but depend on the machine's load); 1 otherwise."""
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if not peers or set(peers) - set(PEERS):
        raise UsageError(f"--peers takes ftsup and/or torchrun, got {args.peers!r}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ftsup-bench-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"ftsup bench recovery in {root} (load average {load_average()})", flush=True)
    env = {"cpus": os.cpu_count(), "loadavg_start": load_average(), "min_step_s": args.min_step_s, "dir": str(root)}
    out: dict[str, Any] = {"results": [], "checks": {}, "environment": env}
    ok = True
    if "ftsup" in peers:
        before = load_average()
        ftsup = bench_ftsup(root / "ftsup", args)
        load = {"start": before, "end": load_average()}
        out["results"] += [{**r, "loadavg": load} for r in ftsup["rows"]]
        out["checks"].update(ftsup["checks"])
        out["checks"]["no_false_alarm_on_slow_save"] = slow_save_check(root / "slow-save", args, ftsup)
        ok = ftsup["ok"]
    if "torchrun" in peers:
        out["results"] += bench_torchrun(root / "torchrun", args)
    env["loadavg_end"] = load_average()
    print(table(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def table(out: dict[str, Any]) -> str:
    head = ("name", "fault", "detect_s", "recover_s", "lost_steps", "orphans", "note")
    rows = [head] + [tuple(_fmt(r.get(k)) for k in head) for r in out["results"]]
    widths = [max(len(r[c]) for r in rows) for c in range(len(head) - 1)]
    lines = ["", *("  ".join(r[c].ljust(w) for c, w in enumerate(widths)) + "  " + r[-1] for r in rows), ""]
    for r in out["results"]:
        if r.get("split"):
            parts = ", ".join(f"{k.removesuffix('_s')} {_fmt(v)}" for k, v in r["split"].items())
            variant = f" [{r['variant']}]" if r.get("variant") else ""
            lines.append(f"split {r['name']} {r['fault']}{variant} (median s): {parts}")
    lines.append("checks:")
    for name, c in out["checks"].items():
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[c.get("pass")]
        shown = {k: v for k, v in c.items() if k not in ("pass", "processes", "events", "note")}
        lines.append(f"  {name}: {verdict} {json.dumps(shown)}")
        if c.get("note"):
            lines.append(f"    note: {c['note']}")
    return "\n".join(lines)
