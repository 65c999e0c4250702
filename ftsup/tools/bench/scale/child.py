"""One world size of `ftsup bench scale`, in a process of its own (`python -m ftsup.tools.bench.scale.child`).

It simulates a job of N ranks (`scale_state`), measures every operation (`scale_ops`; the store's side in a
process of `ftsup.tools.bench.scale.store`, the supervisor's code) under DIR, and writes one JSON object to
--out. A process per world size, so that one N's memory is not another's.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _compare_save_plans

from ftsup.store import layout
from ftsup.tools.bench.scale import ops as scale_ops
from ftsup.tools.bench.scale.measure import measure
from ftsup.tools.bench.scale.state import Job, Model
from ftsup.trainer.checkpoint import staging

FIRST_STEP = 1000


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ftsup.tools.bench.scale.child")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--pp", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--optimizer", action="store_true")
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--budget", type=float, default=20.0, help="seconds of runs after which an operation is not repeated"
    )
    p.add_argument("--sample", type=int, default=2, help="loading ranks planned (the slowest counts)")
    p.add_argument("--recent", type=int, default=2)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--store-timeout", type=float, default=1200.0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Model(
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn,
        vocab=args.vocab,
        dtype=torch.bfloat16,
        optimizer=args.optimizer,
    )
    job = Job(model, args.ranks, args.pp)
    reps = args.repeats
    ops: dict[str, Any] = {}

    last: dict[str, Any] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        """Measure `fn`, a simulated collective (it returns its `Timed`, or a `Planned` holding one)."""
        runs: list[scale_ops.Timed] = []

        def one() -> float:
            last[name] = fn()
            runs.append(last[name].timed if isinstance(last[name], scale_ops.Planned) else last[name])
            return runs[-1].critical_s

        ops[name] = measure(one, reps, budget_s=args.budget)
        median = sorted(runs, key=lambda t: t.critical_s)[len(runs) // 2]  # the parts of the median run
        ops[name].update(
            coordinator_s=median.coordinator_s,
            ranks_before_max_s=max(median.ranks_before_s, default=0.0),
            ranks_after_max_s=max(median.ranks_after_s, default=0.0),
        )

    # The save plan: the engine's first (its compact plan and layout), DCP's planner alone, and the cached one.
    timed("save_plan_first", lambda: scale_ops.save_plan_first(job))
    planned = last.pop("save_plan_first")
    timed("dcp_save_plan", lambda: scale_ops.save_plan_first(job, dcp_only=True))
    dcp = last.pop("dcp_save_plan")
    ops["save_plan_cached"] = measure(lambda: scale_ops.save_plan_cached(job, planned), reps, budget_s=args.budget)
    ops["dcp_save_plan_cached"] = measure(lambda: _dcp_cached(job), reps, budget_s=args.budget)

    # The commit's metadata: the engine's (gather, dcp_metadata.json, manifest.json, rename) and DCP's.
    scratch = args.dir / "commits"
    scratch.mkdir(parents=True)
    step = iter(range(FIRST_STEP, FIRST_STEP + 100))
    timed("commit_metadata", lambda: _then_remove(scale_ops.commit(scratch, job, planned, next(step)), scratch))
    dcp_dir = args.dir / "dcp"
    dcp_dir.mkdir()
    timed("dcp_commit_metadata", lambda: _then_remove(scale_ops.dcp_commit(dcp_dir, job, dcp, next(step)), dcp_dir))
    scale_ops.dcp_commit(dcp_dir, job, dcp, 0)

    # A store of K consistent checkpoints (every rank's files there, sparse), written by the same commit.
    root = args.dir / "store"
    root.mkdir()
    t0 = time.perf_counter()
    for k in range(args.checkpoints):
        scale_ops.commit(root, job, planned, FIRST_STEP + 200 + k, files=True)
    setup_s = time.perf_counter() - t0
    newest = layout.committed_dirs(root)[-1][1]
    store_json = args.dir / "store-ops.json"
    cmd = [sys.executable, "-W", "ignore", "-m", "ftsup.tools.bench.scale.store", "--root", str(root)]
    cmd += ["--repeats", str(reps), "--budget", str(args.budget), "--recent", str(args.recent)]
    cmd += ["--out", str(store_json)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.store_timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the store's measurements failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    ops.update(json.loads(store_json.read_text()))

    # A resharded load plan, N -> N/2 ranks (the engine's, DCP's).
    to_world = max(args.pp, args.ranks // 2)
    timed("load_plan_reshard", lambda: scale_ops.load_plan(newest, job, to_world, args.sample))
    timed("dcp_load_plan_reshard", lambda: scale_ops.dcp_load_plan(dcp_dir / "dcp-0", job, to_world, args.sample))

    return {
        "ranks": args.ranks,
        "pp": job.pp,
        "dp": job.dp,
        "load_ranks": to_world,
        "tensors": len({name for stage in job.stage_tensors for name, _ in stage}),
        "chunks": sum(len(job.rank_state(r)) for r in range(0, job.world_size, job.dp)) * job.dp,
        "checkpoints": args.checkpoints,
        "files_per_checkpoint": len(layout.read_manifest(newest).files) + 1,
        "manifest_bytes": (newest / layout.MANIFEST_NAME).stat().st_size,
        "dcp_metadata_bytes": (newest / layout.DCP_META_NAME).stat().st_size,
        "dcp_pickle_bytes": (dcp_dir / "dcp-0" / ".metadata").stat().st_size,
        "store_setup_s": setup_s,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "ops": ops,
    }


def _dcp_cached(job: Job) -> float:
    """DCP's save plan with its plan cache (`DefaultSavePlanner(enable_plan_caching=True)`), on its costliest
    rank: it still makes the local plan on every save and compares it with the cached one (then sends an
    empty plan); timed as those two calls."""
    rank = max(range(0, job.world_size, job.dp), key=lambda r: len(job.rank_state(r)))
    _, cached = staging.plan_local(job.rank_state(rank), rank == 0)
    flat = job.rank_state(rank)
    t0 = time.perf_counter()
    _, local = staging.plan_local(flat, rank == 0)
    if not _compare_save_plans(local, cached):
        raise RuntimeError("DCP's plans of an unchanged state differ")
    return time.perf_counter() - t0


def _then_remove(t: scale_ops.Timed, directory: Path) -> scale_ops.Timed:
    for p in directory.iterdir():
        shutil.rmtree(p)
    return t


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
