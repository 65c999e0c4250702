"""`ftsup bench goodput`: the share of wall time that becomes training, under one seeded fault schedule, for ftsup,
`torchrun --max-restarts=N` and NVIDIA's `ft_launcher`, side by side (docs/benchmarks.md, "Goodput against torchrun
and ft_launcher"). `schedule` draws the faults, `contenders` starts each launcher, `drive` delivers the faults and
watches, `account` puts every second in one bucket, `report` makes the rows. Never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ftsup.supervisor.errors import UsageError
from ftsup.tools.bench import shared
from ftsup.tools.bench.goodput import contenders as contenders_module
from ftsup.tools.bench.goodput import report, schedule
from ftsup.tools.bench.goodput.account import account
from ftsup.tools.bench.goodput.drive import Options, drive
from ftsup.tools.faults.refjob import new_run_id

DEFAULT_STEPS = 4800  # at least 480 s of steps of 0.1 s: some ten faults per contender at the default interval


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The description and flags of `ftsup bench goodput`."""
    p.description = (
        "Goodput (productive step time / wall time) of the reference trainer under one seeded fault schedule, for "
        "ftsup run, torchrun --max-restarts and ft_launcher (default and tuned timeouts); badput by cause. See "
        "ftsup/tools/bench/goodput/. Runs torch only in subprocesses."
    )
    shared.add_output(p)
    p.add_argument(
        "--steps", type=shared.positive, default=DEFAULT_STEPS, help=f"steps per job, default {DEFAULT_STEPS}"
    )
    p.add_argument(
        "--ckpt-every",
        type=shared.positive,
        default=20,
        help="the trainer's periodic checkpoint interval in steps, for every contender, default 20",
    )
    p.add_argument(
        "--min-step-s", type=shared.seconds, default=0.1, help="the trainer's minimum step time, default 0.1"
    )
    p.add_argument(
        "--mean-interval-s",
        type=shared.seconds,
        default=schedule.DEFAULT_MEAN_INTERVAL_S,
        help="mean wall time between faults, default 60",
    )
    p.add_argument(
        "--mix",
        default=schedule.DEFAULT_MIX,
        type=_mix,
        help=f"fault kinds and their weights, default {schedule.DEFAULT_MIX}",
    )
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed, default 0")
    p.add_argument(
        "--max-faults",
        type=shared.positive,
        default=None,
        help="only the schedule's first N faults (default: every one due while the job runs)",
    )
    p.add_argument(
        "--contenders",
        default=",".join(contenders_module.NAMES),
        help=f"comma-separated, of {', '.join(contenders_module.NAMES)} (default: all)",
    )
    p.add_argument(
        "--max-restarts",
        type=shared.positive,
        default=50,
        help="every launcher's restart budget (torchrun and ft_launcher --max-restarts, ftsup's "
        "restart.max_restarts), default 50",
    )
    p.add_argument(
        "--hang-cap-s",
        type=shared.seconds,
        default=120.0,
        help="end a hang nothing reacted to after this long, as its collective timeout would, default 120",
    )
    p.add_argument(
        "--evict-deadline-s",
        type=shared.seconds,
        default=30.0,
        help="from an eviction notice to the node's loss, default 30",
    )
    p.add_argument("--timeout-s", type=shared.seconds, default=3600.0, help="one contender's whole run, default 3600")
    tuned = contenders_module.NvrxTimeouts()
    p.add_argument(
        "--nvrx-initial-timeout-s",
        type=shared.seconds,
        default=tuned.initial_s,
        help=f"nvrx-tuned: to a rank's first heartbeat, default {tuned.initial_s:g}",
    )
    p.add_argument(
        "--nvrx-heartbeat-timeout-s",
        type=shared.seconds,
        default=tuned.heartbeat_s,
        help=f"nvrx-tuned: between two heartbeats, default {tuned.heartbeat_s:g}",
    )
    p.add_argument(
        "--nvrx-check-interval-s",
        type=shared.seconds,
        default=tuned.check_s,
        help=f"nvrx-tuned: how often its rank monitors check, default {tuned.check_s:g}",
    )


def _mix(text: str) -> dict[str, float]:
    try:
        return schedule.parse_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    tuned = contenders_module.NvrxTimeouts(
        args.nvrx_initial_timeout_s, args.nvrx_heartbeat_timeout_s, args.nvrx_check_interval_s
    )
    try:
        chosen = contenders_module.contenders(
            names, max_restarts=args.max_restarts, evict_deadline_s=args.evict_deadline_s, tuned=tuned
        )
    except ValueError as e:
        raise UsageError(f"--contenders: {e}") from None
    if not chosen:
        raise UsageError(f"--contenders names none of {', '.join(contenders_module.NAMES)}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ftsup-bench-goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    nproc = 2
    faults = schedule.plan(args.seed, args.mean_interval_s, args.mix, nproc=nproc, horizon_s=args.timeout_s)
    faults = faults[: args.max_faults] if args.max_faults else faults
    mix = ",".join(f"{k}={v:g}" for k, v in args.mix.items() if v > 0)
    opts = Options(hang_cap_s=args.hang_cap_s, evict_deadline_s=args.evict_deadline_s, timeout_s=args.timeout_s)
    out: dict[str, Any] = {
        "results": [],
        "schedule": {
            "seed": args.seed,
            "mean_interval_s": args.mean_interval_s,
            "mix": args.mix,
            "hang_cap_s": args.hang_cap_s,
            "evict_deadline_s": args.evict_deadline_s,
            "first": [vars_of(f) for f in faults[:20]],
            "max_faults": args.max_faults,
            "description": f"seed {args.seed}, one every {args.mean_interval_s:g} s on average, {mix}"
            + (f", the first {args.max_faults} only" if args.max_faults else ""),
        },
        "job": {"steps": args.steps, "ckpt_every": args.ckpt_every, "min_step_s": args.min_step_s, "nproc": nproc},
        "environment": {"cpus": os.cpu_count(), "loadavg_start": _load(), "dir": str(root)},
    }
    print(
        f"ftsup bench goodput in {root}: {args.steps} steps per job; faults {out['schedule']['description']}",
        flush=True,
    )
    ok = True
    for c in chosen:
        reason = c.missing()
        if reason is not None:
            print(f"{c.name}: not run: {reason}", flush=True)
            out["results"].append(report.not_run(c.name, c.command, reason))
            continue
        job = c.job(root / c.name, new_run_id(f"goodput-{c.name}"), args.steps, args.ckpt_every, args.min_step_s)
        print(f"{c.name}: {c.command} ...", flush=True)
        got = drive(c, job, faults, opts)
        acc = account(got.timeline)
        r = report.row(c.name, c.command, got, acc, args.hang_cap_s)
        r["loadavg_end"] = _load()
        out["results"].append(r)
        print(
            f"{c.name}: goodput {acc.goodput if acc.goodput is None else round(acc.goodput, 3)}, "
            f"{r['faults_survived']}/{r['faults_delivered']} faults survived, "
            f"{'completed' if got.completed else 'not completed'} in {acc.wall_s:.0f} s",
            flush=True,
        )
        ok = ok and not got.orphans and (got.completed or c.name != "ftsup")
    out["checks"] = report.checks(out["results"])
    out["environment"]["loadavg_end"] = _load()
    print(report.table(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


def vars_of(f: schedule.Fault) -> dict[str, Any]:
    return {"index": f.index, "at_s": f.at_s, "kind": f.kind, "rank": f.rank}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ftsup bench goodput")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
