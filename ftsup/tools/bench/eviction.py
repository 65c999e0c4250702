"""`ftsup bench eviction`: steps lost per eviction, ftsup's emergency save against periodic checkpoints only, on the
same job in the same run, and ftsup's notice -> committed emergency checkpoint against the save time + 2 s.

How the evictions are thrown and what is counted: docs/benchmarks.md, "Evictions: steps lost". Never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftsup.store import layout
from ftsup.tools.faults.refjob import CODE_ROOT, TrainerJob, new_run_id

CKPT_EVERY = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    p.add_argument("--evictions", type=int, default=20, help="evictions per mode (default 20)")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-step-s", type=float, default=0.1, help="step time of the reference trainer")


def _job(work: Path, mode: str, steps: int, min_step_s: float) -> Path:
    eviction = {"signals": ["SIGTERM" if mode == "ftsup" else "SIGUSR2"], "default_deadline_s": 30, "save_margin_s": 2}
    job = TrainerJob(
        work,
        new_run_id(f"bench-eviction-{mode}"),
        steps,
        ckpt_every=CKPT_EVERY,
        min_step_s=min_step_s,
        extra_args=("--n-embd", "128", "--seq-len", "64", "--corpus-bytes", "400000", "--keep-last", "2"),
        sections={"restart": {"backoff_initial_s": 0.2, "stop_grace_s": 5}, "eviction": eviction},
    )
    return job.write_config()


def _lines(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    out = []
    for raw in log.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:  # a line being written
            pass
    return out


def _events(work: Path) -> list[dict[str, Any]]:
    path = work / "state" / "logs" / "supervisor.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _unix(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def _run_mode(work: Path, mode: str, n: int, rnd: random.Random, min_step_s: float) -> list[dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    steps = 100_000  # never reached: every run ends in an eviction
    job = _job(work, mode, steps, min_step_s)
    log = work / "loss.jsonl"
    env = dict(os.environ, PYTHONPATH=str(CODE_ROOT))
    rows = []
    for i in range(n):
        start_lines = len(_lines(log))
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 180
            first = None
            while time.monotonic() < deadline and first is None:  # wait for this run's first step
                new = _lines(log)[start_lines:]
                first = new[0]["step"] if new else None
                time.sleep(0.01)
            if first is None:
                raise RuntimeError(f"{mode}: run {i} never trained")
            # Every third eviction lands right after a periodic checkpoint step (its async save in flight).
            if i % 3 == 2:
                target = (first // CKPT_EVERY + 1) * CKPT_EVERY
            else:
                target = first + rnd.randrange(2, 2 * CKPT_EVERY)
            while time.monotonic() < deadline:
                cur = _lines(log)
                if cur and cur[-1]["step"] >= target:
                    break
                time.sleep(0.005)
            trained = _lines(log)[-1]["step"]
            t_notice = time.time()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        latest = layout.latest_consistent(work / "ckpt")
        resume = latest.step if latest else 0
        trained = max(trained, _lines(log)[-1]["step"])  # steps finished between our read and the notice
        row: dict[str, Any] = {
            "mode": mode,
            "eviction": i,
            "exit": code,
            "trained_step": trained,
            "resume_step": resume,
            "lost_steps": trained - resume,
            "during_periodic_save": i % 3 == 2,
        }
        if mode == "ftsup":
            commits = [e for e in _events(work) if e["event"] == "checkpoint_committed"]
            if commits and _unix(commits[-1]["timestamp"]) >= t_notice - 1:
                row["notice_to_commit_s"] = round(_unix(commits[-1]["timestamp"]) - t_notice, 3)
                row["save_s"] = commits[-1].get("duration_s")
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    rnd = random.Random(args.seed)
    base = args.dir or Path(tempfile.mkdtemp(prefix="ftsup-bench-eviction-"))
    print(f"working in {base}", file=sys.stderr)
    results = []
    for mode in ("ftsup", "periodic"):
        rows = _run_mode(base / mode, mode, args.evictions, rnd, args.min_step_s)
        lost = [r["lost_steps"] for r in rows]
        summary: dict[str, Any] = {
            "name": mode,
            "evictions": len(rows),
            "lost_steps_total": sum(lost),
            "lost_steps_max": max(lost),
            "lost_steps_median": statistics.median(lost),
            "rows": rows,
        }
        if mode == "ftsup":
            lat = [r for r in rows if "notice_to_commit_s" in r]
            if lat:
                summary["notice_to_commit_s_median"] = statistics.median(r["notice_to_commit_s"] for r in lat)
                summary["save_s_median"] = statistics.median(r["save_s"] or 0 for r in lat)
                summary["within_save_plus_2s"] = sum(
                    r["notice_to_commit_s"] <= (r["save_s"] or 0) + 2 for r in lat
                ) / len(lat)
        results.append(summary)
    print(
        f"{'mode':10} {'evictions':>9} {'lost total':>10} {'lost max':>8} {'lost median':>11} "
        f"{'notice->commit':>14} {'save_s':>7}"
    )
    for r in results:
        ntc = r.get("notice_to_commit_s_median")
        sv = r.get("save_s_median")
        print(
            f"{r['name']:10} {r['evictions']:>9} {r['lost_steps_total']:>10} {r['lost_steps_max']:>8} "
            f"{r['lost_steps_median']:>11} {'-' if ntc is None else f'{ntc:.2f}s':>14} "
            f"{'-' if sv is None else f'{sv:.2f}s':>7}"
        )
    ftsup = results[0]
    checks = {
        "ftsup_zero_steps_lost": ftsup["lost_steps_total"] == 0,
        "notice_to_commit_within_save_plus_2s": ftsup.get("within_save_plus_2s") == 1.0,
    }
    print("checks:", json.dumps(checks))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "checks": checks}, indent=1))
    return 0 if all(checks.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ftsup bench eviction", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
