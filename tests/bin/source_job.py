"""A Session whose batches come from a callable drawing from torch's global generator, for tests.

    source_job.py --steps N --record FILE      (alone or under torchrun; the store is FTSUP_CHECKPOINT_DIR)

--record ('{rank}' replaced) gets one JSON line per step: `{"step", "batch_hex"}`, the sum of the step's batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from ftsup import Session


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--record", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(100 + rank)  # streams of the rank's own, as a script seeds them
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = Session(model, optimizer, batches=lambda: torch.randn(3, 4), save_every=3)
    with open(args.record.replace("{rank}", str(rank)), "a") as log:
        for step in session.steps(args.steps):
            for batch in session.micro_batches():
                model(batch).pow(2).mean().backward()
                log.write(json.dumps({"step": step, "batch_hex": float(batch.sum()).hex()}) + "\n")
            optimizer.step()
            optimizer.zero_grad()
    sys.stdout.flush()
    os._exit(0)  # no torch teardown: see ftsup.trainer.examples.gpt


if __name__ == "__main__":
    main()
