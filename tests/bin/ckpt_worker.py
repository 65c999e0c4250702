"""A tiny training rank for checkpoint tests, run under torchrun (or alone, as one rank).

    ckpt_worker.py save --dir D --parallel fsdp|ddp|none --steps 1,2 [--async] [--train-during N]
                        [--kill-at POINT:STEP:RANK] [--process-group auto|none] [--also-dir D2]... --out FILE
    ckpt_worker.py load --dir D --parallel ... [--step N] --out FILE

`save` trains a small model deterministically and saves at the listed steps; `load` builds the
same model with different initial values and loads. Both write, from rank 0, a JSON file with a
SHA-256 of every full (unsharded) tensor in model+optimizer state, so tests compare across world
sizes. `--kill-at` SIGKILLs this rank at a point of the save protocol (engine hook).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ftsup.memtier import MemoryTier
from ftsup.trainer.checkpoint import CheckpointEngine, RetentionPolicy
from ftsup.trainer.checkpoint.stateful import ModelOptimState


def build(parallel: str, seed: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 4),
    )
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in layers:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(layers, mesh=mesh)
    model: torch.nn.Module = layers
    if parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()


def digests(state: ModelOptimState) -> dict[str, str]:
    out = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            full = obj.full_tensor() if hasattr(obj, "full_tensor") else obj
            out[prefix] = hashlib.sha256(
                full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            ).hexdigest()

    walk("", state.state_dict())
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--dir", required=True)
    p.add_argument("--parallel", default="fsdp", choices=["fsdp", "ddp", "none"])
    p.add_argument("--steps", default="1")
    p.add_argument("--step", type=int)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--async", dest="async_", action="store_true")
    p.add_argument("--train-during", type=int, default=0)
    p.add_argument("--kill-at", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--process-group", default="auto", choices=["auto", "none"], help="the engine's process_group")
    p.add_argument("--node-local", action="store_true", help="each rank a node of its own, with --dir/node-<rank>")
    p.add_argument("--ranks-per-node", type=int, default=1, help="with --node-local: ranks r*N..r*N+N-1 a node")
    p.add_argument("--memory", default="", help="the memory tier (with --node-local: DIR/node-<rank>, one replica)")
    p.add_argument("--also-dir", action="append", default=[], help="save: first a save of the last step here too")
    args = p.parse_args()

    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.node_local:  # as `ftsup run` tells the ranks of a job with checkpoint.dir_shared: false
        node, local = f"node-{rank // args.ranks_per_node}", str(rank % args.ranks_per_node)
        os.environ.update({"FTSUP_NODE_ID": node, "LOCAL_RANK": local, "FTSUP_CHECKPOINT_NODE_LOCAL": "1"})
        args.dir = os.path.join(args.dir, node)
        args.memory = args.memory and os.path.join(args.memory, node)

    hook = None
    if args.kill_at:
        point, kstep, krank = args.kill_at.split(":")

        def hook(at: str, step: int) -> None:
            if at == point and step == int(kstep) and rank == int(krank):
                os.kill(os.getpid(), signal.SIGKILL)

    model, optim = build(args.parallel, seed=0 if args.mode == "save" else 99, width=args.width)
    state = ModelOptimState(model, optim)
    group = None if args.process_group == "none" else "auto"
    memory = MemoryTier(args.memory, keep_last=2) if args.memory else None
    for also in args.also_dir:  # the same save first into each of these, with an engine of its own
        more = CheckpointEngine(also, process_group=group, retention=RetentionPolicy(keep_last=10))
        more.save(max(map(int, args.steps.split(","))), {"app": state}, rank_state={"rank": rank})
        more.close()
    engine = CheckpointEngine(
        args.dir, process_group=group, retention=RetentionPolicy(keep_last=10), hook=hook, memory=memory
    )
    result: dict[str, object] = {}
    if args.mode == "save":
        for step in range(1, max(map(int, args.steps.split(","))) + 1):
            train_step(model, optim, step)
            if str(step) in args.steps.split(","):
                ret = engine.save(
                    step,
                    {"app": state},
                    rank_state={"rank": rank, "step": step},
                    metadata={"global_batch": 8},
                    block=not args.async_,
                )
                if args.async_:
                    before = digests(state)
                    for _ in range(args.train_during):  # training goes on during the write
                        train_step(model, optim, 10_000 + step)
                    ret.wait()
                    result["trained_during"] = args.train_during
                    result[f"digests_after_{step}"] = digests(state)
                    result[f"digests_{step}"] = before
                    continue
                result[f"tiers_{step}"] = list(ret.tiers)
            result[f"digests_{step}"] = digests(state)
        engine.wait()
    else:
        started = time.perf_counter()
        loaded = engine.load({"app": state}, step=args.step)
        wall = time.perf_counter() - started
        result.update(
            step=loaded.step,
            rank_state=loaded.rank_state,
            metadata=dict(loaded.metadata),
            digests=digests(state),
            saved_world_size=loaded.saved_world_size,
        )
        all_bytes: list[object] = [loaded.bytes_read]
        all_tiers: list[object] = [loaded.tier]
        walls: list[object] = [wall]
        if dist.is_initialized():
            all_bytes = [None] * dist.get_world_size()
            dist.all_gather_object(all_bytes, loaded.bytes_read)
            all_tiers = [None] * dist.get_world_size()
            dist.all_gather_object(all_tiers, loaded.tier)
            walls = [None] * dist.get_world_size()
            dist.all_gather_object(walls, wall)
        result["bytes_read"] = all_bytes
        result["tiers"] = all_tiers
        result["load_wall_s"] = walls
    engine.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
