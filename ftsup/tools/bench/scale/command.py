"""`ftsup bench scale`: what a save, a commit, a resume choice and the supervisor cost at thousands of ranks, by
simulation.

Each world size of --ranks runs in a process of its own (`child`) through the product's code paths; this one
launches, collects and reports (`report`). What is measured: docs/benchmarks.md, "Performance at scale".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftsup.tools.bench.scale import report as scale_report

DEFAULT_RANKS = (256, 1024, 4096, 16384)


def _ranks(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of world sizes") from None
    if not out or out[0] < 1 or out[-1] > 1 << 20:
        raise argparse.ArgumentTypeError(f"world sizes must be between 1 and {1 << 20}, got {text!r}")
    return out


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    p.add_argument(
        "--ranks",
        type=_ranks,
        default=list(DEFAULT_RANKS),
        help="world sizes to simulate, comma-separated (default 256,1024,4096,16384)",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--dir", type=Path, default=None, help="folder to write under (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep what was written")
    p.add_argument("--pp", type=_positive(int), default=16, help="pipeline stages (default 16)")
    p.add_argument("--layers", type=_positive(int), default=32, help="transformer layers (default 32: 7B-like)")
    p.add_argument("--hidden", type=_positive(int), default=4096)
    p.add_argument("--ffn", type=_positive(int), default=11008)
    p.add_argument("--vocab", type=_positive(int), default=32000)
    p.add_argument("--optimizer", action="store_true", help="add AdamW's two moments per parameter (3x the tensors)")
    p.add_argument("--checkpoints", type=_positive(int), default=3, help="checkpoints in the store (default 3)")
    p.add_argument("--repeats", type=_positive(int), default=3, help="runs of each operation (default 3)")
    p.add_argument(
        "--budget",
        type=_positive(float),
        default=20.0,
        help="seconds after which an operation is not run again (default 20; at least one run)",
    )
    p.add_argument("--timeout", type=_positive(float), default=1800.0, help="seconds per world size (default 1800)")


def run(args: argparse.Namespace) -> int:
    base = Path(tempfile.mkdtemp(prefix="ftsup-bench-scale-", dir=args.dir))
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    t0 = time.monotonic()
    try:
        for n in args.ranks:
            if n % args.pp:
                failures.append(f"N={n}: not a multiple of --pp {args.pp}")
                continue
            print(f"simulating {n} ranks ...", file=sys.stderr, flush=True)
            result, error = _one(args, n, base / f"n{n}")
            if error:
                failures.append(f"N={n}: {error}")
            else:
                results.append(result)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    report: dict[str, Any] = {
        "benchmark": "scale",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "handler"},
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "wall_s": time.monotonic() - t0,
        "results": results,
        "growth": {op: scale_report.growth(results, op) for r in results[:1] for op in r["ops"]},
        "targets": scale_report.targets(results) if results else None,
        "failures": failures,
    }
    if results:
        print(scale_report.table(results))
        print()
        print(scale_report.targets_text(report["targets"]))
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failures else 0


def _one(args: argparse.Namespace, n: int, work: Path) -> tuple[dict[str, Any], str | None]:
    """One world size in a child process (reaped: `subprocess.run` kills it at the timeout and waits)."""
    work.mkdir(parents=True)
    out = work / "result.json"
    cmd = [sys.executable, "-W", "ignore", "-m", "ftsup.tools.bench.scale.child", "--ranks", str(n)]
    cmd += ["--pp", str(args.pp), "--layers", str(args.layers), "--hidden", str(args.hidden), "--ffn", str(args.ffn)]
    cmd += ["--vocab", str(args.vocab), "--checkpoints", str(args.checkpoints), "--repeats", str(args.repeats)]
    cmd += ["--budget", str(args.budget), "--dir", str(work / "store"), "--out", str(out)]
    if args.optimizer:
        cmd.append("--optimizer")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {}, f"no result within {args.timeout:g}s"
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or "").strip().splitlines()[-5:]
        return {}, f"exit status {done.returncode}: " + " | ".join(tail)
    return json.loads(out.read_text()), None
