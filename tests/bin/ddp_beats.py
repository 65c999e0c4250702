"""Plain torch DDP on gloo with the one line of ftsup a script needs for hang detection, `runtime().beat(step)`, and
rank 0 alone evaluating inside `runtime().phase("eval")`; it never resumes, for tests of what the supervisor makes of
its beats.

    ddp_beats.py --steps N --dir DIR [--step-s S] [--eval-every K --eval-s S]

Run by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, ...). Each step trains a tiny linear model (its gradients are
all-reduced, so the ranks wait for each other there) and is padded to S seconds. Every K steps rank 0 evaluates for
--eval-s seconds while the other ranks go on into the next step and wait for it in its all-reduce: no barrier. Every
rank prints `rank R step N` to stdout every 10 steps and writes `{"pid", "step", "attempt"}` to DIR/rank-R.json after
each step, so that a test can find a rank to signal at a known step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftsup import runtime


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-s", type=float, default=5.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attempt = os.environ.get("FTSUP_ATTEMPT", "0")
    print(f"rank {rank} starts, attempt {attempt}", flush=True)
    for step in range(1, args.steps + 1):
        began = time.monotonic()
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(max(0.0, args.step_s - (time.monotonic() - began)))
        runtime().beat(step)
        (args.dir / f"rank-{rank}.json").write_text(json.dumps({"pid": os.getpid(), "step": step, "attempt": attempt}))
        if step % 10 == 0:
            print(f"rank {rank} step {step}", flush=True)
        if rank == 0 and args.eval_every and step % args.eval_every == 0 and step < args.steps:
            with runtime().phase("eval"), torch.no_grad():
                end = time.monotonic() + args.eval_s
                model.module(x)  # an evaluation that takes its time
                time.sleep(max(0.0, end - time.monotonic()))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
