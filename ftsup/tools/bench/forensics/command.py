"""`ftsup bench forensics`: capture the evidence of a hang (`run.forensics`, as the supervisor does before a kill)
from a node of hung gloo ranks, again and again, with each choice of stack tools; medians and spread per choice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from ftsup import procs
from ftsup.supervisor.config.job import parse_config
from ftsup.supervisor.policy.events import CaptureEvidence
from ftsup.supervisor.run.forensics import Forensics, Target
from ftsup.supervisor.run.outages import Outages
from ftsup.tools.bench import shared

CHOICES = {  # row name -> forensics.tools
    "pystack+py-spy": ["pystack", "py-spy"],
    "pystack": ["pystack"],
    "py-spy": ["py-spy"],
    "proc": [],
}
START_S = 300.0  # the ranks' imports on a loaded host
POLL_S = 0.1  # how often the ranks' files are looked for
SETTLE_S = 0.3  # the ranks waiting in the all-reduce: their CPU time unchanged over this
SETTLE_LIMIT_S = 60.0  # before each capture, the longest waited for the ranks to be as hung again


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Start --ranks gloo DDP ranks under torchrun whose rank 1 hangs (--how stop: SIGSTOP; spin: a Python loop) "
        "while the others wait for it in an all-reduce, then capture their evidence as the supervisor does before a "
        "kill, --rounds times with each choice of stack tools (rows: " + ", ".join(CHOICES) + "), the rows "
        "interleaved; report each row's capture time (median, p10, p90), the ranks with a stack and the culprit named."
    )
    shared.add_output(p, work_dir=False)
    p.add_argument("--ranks", type=int, default=8, help="local ranks, default 8")
    p.add_argument("--rounds", type=int, default=5, help="captures per row, default 5")
    p.add_argument("--how", choices=("stop", "spin"), default="stop", help="how rank 1 hangs, default stop")
    p.add_argument("--timeout-s", type=float, default=3.0, help="the capture's bound (forensics.timeout_s), default 3")


def run(args: argparse.Namespace) -> int:
    if args.ranks < 2 or args.rounds < 1:
        raise SystemExit("ftsup bench forensics: --ranks must be at least 2 and --rounds at least 1")
    with tempfile.TemporaryDirectory(prefix="ftsup-bench-forensics-") as tmp:
        root = Path(tmp)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"]
        argv += ["-m", "ftsup.tools.bench.forensics.hungrank", "--dir", str(root), "--how", args.how]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with (root / "ranks.log").open("wb") as log:
            job = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            targets = _hung(root, args.ranks, args.how, job)
            load_before = os.getloadavg()
            rows = _measure(root, targets, args)
            load_after = os.getloadavg()
        finally:
            procs.stop(lambda: procs.descendants([job.pid]), 1.0, reap=job.poll)  # stopped ranks are continued first
            job.wait()
    result = {
        "ranks": args.ranks,
        "how": args.how,
        "timeout_s": args.timeout_s,
        "load_avg": {"before": list(load_before), "after": list(load_after)},
        "results": rows,
    }
    print(f"the evidence of a hang: {args.ranks} ranks, rank 1 hung ({args.how}), bound {args.timeout_s:g} s")
    print(f"  {'tools':16}{'median':>9}{'p10':>9}{'p90':>9}{'max':>9}  stacks  culprit  stacks by (all captures)")
    for r in rows:
        cells = "".join(f"{r[f'capture_s_{k}']:>8.2f}s" for k in ("median", "p10", "p90", "max"))
        by = ", ".join(f"{k} {v}" for k, v in r["stacks_by"].items())
        named = ", ".join(sorted({c.split(":")[0] for c in r["culprits"]}))
        print(f"  {r['name']:16}{cells}  {r['stacks_min']:>2}/{args.ranks}   {named:7}  {by}")
    for r in rows:
        print(f"  {r['name']}: culprit " + "; ".join(f"rank {c}" for c in r["culprits"]))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _hung(root: Path, n: int, how: str, job: subprocess.Popen[bytes]) -> list[Target]:
    """The ranks once each wrote its pid, rank 1 hangs (`how`) and the others wait for it."""
    deadline = time.monotonic() + START_S
    while len(list(root.glob("rank-*.pid"))) < n:
        if job.poll() is not None or time.monotonic() > deadline:
            tail = (root / "ranks.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"ftsup bench forensics: the ranks did not start and hang: {tail}")
        time.sleep(POLL_S)
    pids = [int((root / f"rank-{r}.pid").read_text()) for r in range(n)]
    ticks = [(procs.run_state(pid) or ("", None))[1] for pid in pids]
    targets = [Target(r, r, pid, ticks[r]) for r, pid in enumerate(pids)]
    _settle(targets, how, deadline)
    return targets


def _settle(targets: list[Target], how: str, deadline: float) -> None:
    """Until rank 1 hangs (`how`) and the others wait for it in the all-reduce (asleep, their CPU time still): the
    state each capture starts from, whatever the capture before it left."""
    hung = "T" if how == "stop" else "R"
    waiting = [i for i, t in enumerate(targets) if t.rank != 1]
    cpu: list[float] = []
    while True:
        states = [(procs.run_state(t.pid) or ("gone", None))[0] for t in targets]
        now = [_cpu_s(t.pid) for t in targets]
        if states == [hung if t.rank == 1 else "S" for t in targets] and cpu and all(now[i] == cpu[i] for i in waiting):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"ftsup bench forensics: the ranks are not as hung (rank 1 {hung}, others S): {states}")
        cpu = now
        time.sleep(SETTLE_S)


def _cpu_s(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return -1.0
    return times.user + times.system


def _measure(root: Path, targets: list[Target], args: argparse.Namespace) -> list[dict[str, Any]]:
    took: dict[str, list[float]] = {name: [] for name in CHOICES}
    stacks: dict[str, list[int]] = {name: [] for name in CHOICES}
    by_tool: dict[str, Counter[str]] = {name: Counter() for name in CHOICES}
    inside: dict[str, list[int]] = {name: [] for name in CHOICES}
    continued: dict[str, int] = dict.fromkeys(CHOICES, 0)
    culprits: dict[str, set[str]] = {name: set() for name in CHOICES}
    said: list[tuple[str, str]] = []
    outages = Outages(lambda level, event, **f: said.append((event, str(f))), lambda purpose: None, time.monotonic)
    for i in range(args.rounds):
        order = list(CHOICES) if i % 2 == 0 else list(reversed(CHOICES))
        for name in order:
            raw = {
                "job": {"command": ["true"], "state_dir": str(root / "state" / name)},
                "forensics": {"tools": CHOICES[name], "timeout_s": args.timeout_s, "keep": 1000},
            }
            cfg = parse_config(raw, base_dir=root, hostname="bench")
            forensics = Forensics(
                cfg, root / "state" / name, clock=time.monotonic, emit=lambda *a, **k: None, outages=outages
            )
            _settle(targets, args.how, time.monotonic() + SETTLE_LIMIT_S)
            action = CaptureEvidence(1, "hang", "heartbeat_timed_out", "bench", args.timeout_s)
            try:
                incident = forensics.capture(action, targets, None)
            finally:
                forensics.close()  # also when interrupted: its threads end by the bound, their tools killed
            if incident is None:
                raise SystemExit(f"ftsup bench forensics: no record written: {said}")
            took[name].append(incident.duration_s or 0.0)
            stacks[name].append(sum(r.tool is not None for r in incident.ranks))
            by_tool[name].update(r.tool or "none" for r in incident.ranks)
            inside[name].append(sum(r.collective is True for r in incident.ranks))
            continued[name] += sum(any(p.startswith("continued") for p in r.problems) for r in incident.ranks)
            culprits[name].add(f"{incident.culprit}: {incident.culprit_why}")
    rows = []
    for name in CHOICES:
        s = shared.spread(took[name])
        rows.append(
            {
                "name": name,
                "captures": len(took[name]),
                **{f"capture_s_{k}": round(v, 3) for k, v in s.items()},
                "capture_s_max": round(max(took[name]), 3),
                "stacks_min": min(stacks[name]),
                "stacks_by": dict(sorted(by_tool[name].items())),
                "in_collective_min": min(inside[name]),
                "continued": continued[name],
                "culprits": sorted(culprits[name]),
            }
        )
    return rows
