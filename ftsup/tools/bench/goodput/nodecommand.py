"""`ftsup bench node-loss`: goodput of a two-node job under a seeded schedule of node losses (node B killed whole,
its disk and memory wiped, replaced), for ftsup with the peer-memory tier, ftsup with the durable tier instead,
plain elastic torchrun and ft_launcher, side by side (docs/benchmarks.md, "Goodput under node losses"). Never
imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ftsup.supervisor.errors import UsageError
from ftsup.tools.bench import shared
from ftsup.tools.bench.goodput import nodeloss, twonode
from ftsup.tools.bench.goodput.account import account
from ftsup.tools.bench.goodput.nodedrive import drive
from ftsup.tools.faults.nodes import free_port
from ftsup.tools.faults.refjob import TrainerJob, new_run_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The description and flags of `ftsup bench node-loss`."""
    p.description = (
        "Goodput of the reference trainer as one job of two nodes on 127.0.0.1 under a seeded schedule of node "
        "losses (node B killed, its disk and memory wiped, replaced --replace-s later), for ftsup with the "
        "peer-memory tier, ftsup with the durable tier on a local SeaweedFS, plain elastic torchrun and ft_launcher."
    )
    shared.add_output(p)
    p.add_argument("--steps", type=shared.positive, default=300, help="steps of the job, default 300")
    p.add_argument("--ckpt-every", type=shared.positive, default=10, help="periodic checkpoint interval, default 10")
    p.add_argument("--min-step-s", type=shared.seconds, default=0.1, help="the trainer's minimum step, default 0.1")
    p.add_argument("--losses", type=shared.positive, default=2, help="node losses per contender, default 2")
    p.add_argument(
        "--mean-interval-s",
        type=shared.seconds,
        default=20.0,
        help="mean wall time between node losses (Poisson), default 20",
    )
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed, default 0")
    p.add_argument(
        "--replace-s", type=shared.seconds, default=10.0, help="from a loss to the replacement's start, default 10"
    )
    p.add_argument(
        "--contenders",
        default=",".join(twonode.NAMES),
        help=f"comma-separated, of {', '.join(twonode.NAMES)} (default: all)",
    )
    p.add_argument(
        "--nnodes",
        choices=("1:2", "2:2"),
        default="1:2",
        help="every launcher's node range: 1:2, the survivor trains alone until the replacement joins (default); "
        "2:2, it waits for it",
    )
    p.add_argument("--max-restarts", type=shared.positive, default=50, help="every launcher's budget, default 50")
    p.add_argument("--timeout-s", type=shared.seconds, default=1200.0, help="one contender's whole run, default 1200")


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM to the bench raises SystemExit, so that every `finally` below reaps what it started."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _memory_root() -> Path:
    """The memory tier's directories: in /dev/shm (a tmpfs) where there is one, else the temporary directory."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="ftsup-bench-node-loss-", dir=shm if shm.is_dir() else None))


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    try:
        twonode.contenders(names, None)
    except ValueError as e:
        raise UsageError(f"--contenders: {e}") from None
    if not names:
        raise UsageError(f"--contenders names none of {', '.join(twonode.NAMES)}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ftsup-bench-node-loss-"))
    root.mkdir(parents=True, exist_ok=True)
    times = nodeloss.loss_times(args.seed, args.mean_interval_s, args.losses, args.timeout_s)
    out: dict[str, Any] = {
        "results": [],
        "schedule": {
            "seed": args.seed,
            "mean_interval_s": args.mean_interval_s,
            "losses": args.losses,
            "at_s": times,
            "replace_s": args.replace_s,
            "description": f"seed {args.seed}: node B lost at {', '.join(f'{t:.0f}' for t in times)} s "
            f"after both nodes first trained together (each once they train together again), "
            f"replaced {args.replace_s:g} s later",
        },
        "job": {
            "steps": args.steps,
            "ckpt_every": args.ckpt_every,
            "min_step_s": args.min_step_s,
            "nodes": 2,
            "nnodes": args.nnodes,
        },
        "environment": {"cpus": os.cpu_count(), "loadavg_start": _load(), "dir": str(root)},
    }
    print(
        f"ftsup bench node-loss in {root}: {args.steps} steps, --nnodes {args.nnodes}; "
        f"{out['schedule']['description']}",
        flush=True,
    )
    ok = True
    with _sigterm_unwinds(), contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        url = None
        if "ftsup-durable" in names:
            from ftsup.tools.bench.seaweed import Seaweed

            store = stack.enter_context(Seaweed(root / "seaweedfs", bucket="node-loss"))
            env, url = store.env(), "s3://node-loss/job"
        memory_root = _memory_root()
        stack.callback(shutil.rmtree, memory_root, True)
        for c in twonode.contenders(names, url):
            reason = c.missing()
            if reason is not None:
                print(f"{c.name}: not run: {reason}", flush=True)
                out["results"].append(nodeloss.not_run(c.name, c.command, reason))
                continue
            r = _one(c, args, root, memory_root, env)
            out["results"].append(r)
            if args.json:  # each row as soon as it is measured: a later contender may run until its timeout
                Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
            ok = ok and not r["orphans"] and (r["completed"] or not c.name.startswith("ftsup"))
    out["checks"] = nodeloss.checks(out["results"])
    out["environment"]["loadavg_end"] = _load()
    print(nodeloss.table(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


def _one(c: twonode.NodeContender, args: argparse.Namespace, root: Path, memory: Path, env: dict[str, str]) -> dict:
    base = TrainerJob(
        root / c.name,
        new_run_id(f"nl-{c.name}"),
        args.steps,
        ckpt_every=args.ckpt_every,
        min_step_s=args.min_step_s,
        nproc=1,
    )
    job = twonode.TwoNodeJob(base, free_port(), memory / c.name, args.max_restarts, args.nnodes)
    print(f"{c.name}: {c.command} ...", flush=True)
    times = nodeloss.loss_times(args.seed, args.mean_interval_s, args.losses, args.timeout_s)
    got = drive(c, job, times, replace_s=args.replace_s, timeout_s=args.timeout_s, env=env)
    losses = [nodeloss.per_loss(got.lines, loss, got.t0) for loss in got.losses]
    acc = account(nodeloss.timeline(got.lines, got.losses, got.t0, got.end, args.ckpt_every))
    r = nodeloss.row(
        c.name,
        c.command,
        acc,
        losses,
        nodeloss.loads(got.output),
        completed=got.completed,
        exit_codes=got.exit_codes,
        launches=got.launches,
        ended_by=got.ended_by,
        orphans=got.orphans,
        loadavg_end=_load(),
        # the raw marks, seconds from the first launch, from which every figure above can be worked out again
        raw={
            "lines": [[round(ln.t - got.t0, 3), ln.step, ln.world_size] for ln in got.lines],
            "losses": [
                [round(x.t - got.t0, 3), x.max_step_before, None if x.back_t is None else round(x.back_t - got.t0, 3)]
                for x in got.losses
            ],
            "end_s": round(got.end - got.t0, 3),
        },
    )
    print(
        f"{c.name}: goodput {r['goodput']}, {len(losses)} loss(es), "
        f"lost steps {[x['lost_steps_total'] for x in losses]}"
        f", tiers {r['resume_tiers']}, {'completed' if got.completed else 'not completed: ' + str(got.ended_by)}"
        f" in {acc.wall_s:.0f} s",
        flush=True,
    )
    return r


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
