"""Plain torch DDP on gloo that beats once a step (`runtime().beat(step)`), and whose rank R hangs at step K, for
the tests of the evidence a hang leaves behind:

    hang_rank.py --steps N --dir DIR --at K --rank R --how stop|spin

`stop`: rank R stops itself (SIGSTOP) after step K's beat; `spin`: it loops in Python for ever (`while True`), never
stepping again. Either way the other ranks go on into step K+1 and wait for it in DDP's gradient all-reduce. Every
rank writes `{"pid", "step", "attempt"}` to DIR/rank-R.json after each step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftsup import runtime


def spin() -> None:
    n = 0
    while True:  # the hang a stack must show: a rank busy in Python, not in a collective
        n += 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--at", type=int, required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--how", choices=("stop", "spin"), required=True)
    p.add_argument("--step-s", type=float, default=0.02)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attempt = os.environ.get("FTSUP_ATTEMPT", "0")
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
        if rank == args.rank and step == args.at and attempt == "1":
            print(f"rank {rank} hangs at step {step} ({args.how})", file=sys.stderr, flush=True)  # its last line
            if args.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                spin()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
