"""A small training job on `ftsup.Session` for tests: a linear model with dropout on generated data.

    session_job.py --steps N --record FILE [--save-every K] [--eval-every E --eval-s S]
                   [--eval-timeout-s T] [--hang-in-eval] [--control-rank R]

Alone, under torchrun or under `ftsup run` (the checkpoint directory is FTSUP_CHECKPOINT_DIR).
--record ('{rank}' replaced) gets one JSON line per step, `{"step", "loss_hex", "world_size"}`, and
a last one `{"end": step, "stopped": bool, "finished": bool}`. Every --eval-every steps an
evaluation of --eval-s seconds runs in `session.phase("eval", timeout_s=--eval-timeout-s)`; with
--hang-in-eval, the first one of attempt 1 never ends (its work is stuck while the process lives).
--control-rank R: only rank R reads the supervisor's control file (the others are given none), so
that a request reaches the job through one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ftsup import Session
from ftsup.protocol import ATTEMPT_ENV, CONTROL_FILE_ENV


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-s", type=float, default=0.0)
    p.add_argument("--eval-timeout-s", type=float)
    p.add_argument("--hang-in-eval", action="store_true")
    p.add_argument("--control-rank", type=int)
    args = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.control_rank is not None and rank != args.control_rank:
        os.environ.pop(CONTROL_FILE_ENV, None)  # read once, by the runtime client the Session makes

    torch.manual_seed(0)
    data = list(torch.randn(96, 8, generator=torch.Generator().manual_seed(1)))
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = Session(
        model, optimizer, None, data, global_batch=8, micro_batch=2, save_every=args.save_every, config={"width": 16}
    )
    hang = args.hang_in_eval and os.environ.get(ATTEMPT_ENV) == "1"
    with open(args.record.replace("{rank}", str(rank)), "a") as log:
        for step in session.steps(args.steps):
            total = torch.zeros((), dtype=torch.float64)
            for batch in session.micro_batches():
                loss = model(batch).pow(2).mean()
                (loss / session.accumulation_steps).backward()
                total += loss.detach().double()
            if dist.is_initialized():
                dist.all_reduce(total)
            optimizer.step()
            optimizer.zero_grad()
            session.report(loss=float(total))
            log.write(json.dumps({"step": step, "loss_hex": float(total).hex(), "world_size": session.world_size}))
            log.write("\n")
            log.flush()
            if args.eval_every and step % args.eval_every == 0:
                with session.phase("eval", timeout_s=args.eval_timeout_s):
                    deadline = time.monotonic() + args.eval_s
                    while hang or time.monotonic() < deadline:
                        time.sleep(0.01)  # the evaluation's work (stuck for good with --hang-in-eval)
        log.write(json.dumps({"end": session.step, "stopped": session.stopped, "finished": session.finished}) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no torch teardown: see ftsup.trainer.examples.gpt


if __name__ == "__main__":
    sys.exit(main())
