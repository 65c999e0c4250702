"""Two or more ranks check one step with the step guard, rank --nan-rank's loss NaN (its gradients
finite): each rank writes what it decided to --out ('{rank}' replaced) as JSON, `{"refused",
"mean_loss", "grad_norm"}`.

    torchrun --nproc-per-node 2 tests/bin/guard_ranks.py --nan-rank 1 --out out.{rank}.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist

from ftsup.trainer.stepguard import StepGuard


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nan-rank", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    shown = math.nan if rank == args.nan_rank else float(loss)  # a loss that went wrong after backward
    check = StepGuard(optimizer).check(torch.tensor(shown), torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    with open(args.out.replace("{rank}", str(rank)), "w") as f:
        json.dump({"refused": check.refused, "mean_loss": check.mean_loss, "grad_norm": check.grad_norm}, f)
    sys.stdout.flush()
    os._exit(0)  # no torch teardown: see ftsup.trainer.examples.gpt


if __name__ == "__main__":
    main()
