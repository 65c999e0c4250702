"""The peer memories' cost to training: the stall of an async save into the store and the memory tier with one
replica on a peer against the same save with none, each rank a node of its own, in pairs whose order alternates;
run under torchrun (docs/benchmarks.md, "Peer memories"):
`python -m torch.distributed.run --standalone --nproc-per-node 2 -m ftsup.tools.bench.checkpoint.peer_stall`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = ("ftsup_async_peers", "ftsup_async_memory")


def main() -> int:
    p = argparse.ArgumentParser(prog="peer_stall")
    p.add_argument("--size-mb", type=int, default=256, help="the state's size, all ranks together")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-steps", type=int, default=8)
    p.add_argument("--json", default="")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    from ftsup import protocol

    os.environ.update({protocol.NODE_ID_ENV: f"node-{rank}", "LOCAL_RANK": "0", protocol.NODE_LOCAL_ENV: "1"})
    import torch
    import torch.distributed as dist

    from ftsup.memtier import MemoryTier
    from ftsup.trainer.checkpoint import CheckpointEngine, RetentionPolicy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    per = args.size_mb * (1 << 20) // world // 4
    state = {f"r{rank}": {f"t{i}": torch.randn(per // 8) for i in range(8)}}
    a, b = torch.randn(192, 192), torch.randn(192, 192)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            a.copy_(torch.tanh(a @ b) * 0.5)
        flag = torch.tensor([0])
        dist.all_reduce(flag)  # ranks in lockstep, as training's collectives keep them
        return time.perf_counter() - t0

    base = Path(tempfile.mkdtemp(prefix=f"ftsup-peer-stall-{rank}-"))
    shm = Path(
        tempfile.mkdtemp(prefix=f"ftsup-peer-stall-{rank}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    engines = {
        name: CheckpointEngine(
            base / name,
            retention=RetentionPolicy(keep_last=1),
            memory=MemoryTier(str(shm / name), keep_last=1, replicas=1 if name == ROWS[0] else 0),
            durable_tier=None,
            fallback_dir=None,
        )
        for name in ROWS
    }
    records: dict[str, list[dict[str, float]]] = {name: [] for name in ROWS}
    try:
        n = 0
        for name in ROWS:  # each engine's plan and buffers made, unmeasured
            n += 1
            engines[name].save(n, state).wait()
        for i in range(args.repeats):
            for name in ROWS if i % 2 == 0 else tuple(reversed(ROWS)):
                n += 1
                baseline = statistics.median(step() for _ in range(args.baseline_steps))
                dist.barrier()
                t0 = time.perf_counter()
                handle = engines[name].save(n, state)
                block = time.perf_counter() - t0
                extra, steps = 0.0, 0
                while True:
                    extra += max(0.0, step() - baseline)
                    steps += 1
                    done = torch.tensor([0 if handle.done() else 1])
                    dist.all_reduce(done, op=dist.ReduceOp.MAX)
                    if not done.item():
                        break
                result = handle.wait()
                row = {"stall_s": block + extra, "block_s": block, "steps_during": steps, "durable_s": result.durable_s}
                records[name].append(row | {"baseline_step_s": baseline, "tiers": len(result.tiers)})
    finally:
        for eng in engines.values():
            eng.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        out = _report(gathered, args.size_mb, world)
        print(json.dumps(out, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    return 0


def _report(per_rank: list[dict[str, list[dict[str, float]]]], size_mb: int, world: int) -> dict[str, Any]:
    """Each row's median over repeats of the slowest rank's stall, and the ratio of the medians."""
    rows: list[dict[str, Any]] = []
    medians: list[float] = []
    for name in ROWS:
        stalls = [max(r[name][i]["stall_s"] for r in per_rank) for i in range(len(per_rank[0][name]))]
        saves = [max(r[name][i]["durable_s"] for r in per_rank) for i in range(len(per_rank[0][name]))]
        medians.append(statistics.median(stalls))
        rows.append(
            {
                "name": name,
                "stall_s": round(medians[-1], 4),
                "stall_each": [round(s, 4) for s in stalls],
                "save_s": round(statistics.median(saves), 4),
                "tiers": per_rank[0][name][0]["tiers"],
            }
        )
    ratio = medians[0] / medians[1] if medians[1] > 0 else None
    return {"size_mb": size_mb, "ranks": world, "results": rows, "ratios": {"peers_stall_vs_memory": ratio}}


if __name__ == "__main__":
    raise SystemExit(main())
