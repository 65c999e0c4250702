"""A rank of `ftsup bench forensics`, run by torchrun: tiny DDP on gloo that steps a few times, then hangs as a real
hang does: rank `--rank` stops itself (SIGSTOP) or loops in Python, and the others wait for it in the next step's
gradient all-reduce. Each rank writes its pid to DIR/rank-R.pid once it reached its last step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--how", choices=("stop", "spin"), default="stop")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    for step in range(6):
        model(torch.randn(4, 8)).sum().backward()
        if step == 4:
            (args.dir / f"rank-{rank}.pid.tmp").write_text(str(os.getpid()))
            os.replace(args.dir / f"rank-{rank}.pid.tmp", args.dir / f"rank-{rank}.pid")
            if rank == args.rank:
                if args.how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                spin()
    return 0


def spin() -> None:
    n = 0
    while True:
        n += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
