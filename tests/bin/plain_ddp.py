"""A training script without a line of ftsup: plain torch DDP on gloo that checkpoints itself with `torch.save` and
resumes from its own checkpoint, for tests of zero-line supervision (`ftsup run -- ...`).

    plain_ddp.py --steps N --dir DIR [--ckpt-every K] [--step-s S]

Run by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, ...). Each step trains a tiny linear model on data drawn from the
step number, then sleeps S seconds (a step long enough for a test to act mid-run). Every K steps rank 0 writes
DIR/ckpt.pt (written aside, then renamed over the old one); at start every rank loads it when it exists. Rank 0
appends `{"step", "loss", "first_step"}` to DIR/loss.jsonl each step (`first_step`: where this process began), and
every rank writes `{"pid", "step"}` to DIR/rank-R.json, so that a test can find a rank to kill at a known step.
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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--step-s", type=float, default=0.1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = args.dir / "ckpt.pt"
    step = 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    first = step + 1
    while step < args.steps:
        step += 1
        data = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=data)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_s)
        (args.dir / f"rank-{rank}.json").write_text(json.dumps({"pid": os.getpid(), "step": step}))
        if rank == 0:
            with (args.dir / "loss.jsonl").open("a") as log:
                log.write(json.dumps({"step": step, "loss": loss.item(), "first_step": first}) + "\n")
            if step % args.ckpt_every == 0:
                aside = ckpt.with_suffix(".tmp")
                torch.save(
                    {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, aside
                )
                os.replace(aside, ckpt)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
