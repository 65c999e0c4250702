"""What the finiteness check of a save costs on the reference trainer's state (`finite`), run by hand:
`python -m ftsup.tools.bench.checkpoint.finite [--n-embd 256 --n-layer 4 --repeats 20 --threads 1]`.

Stages the model's and AdamW's state after one step as a save does, on the CPU, and prints one JSON line: the
state's bytes, the median times of the staging copy and of the scan of the staged buffer, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ftsup.trainer.checkpoint import codec, staging
from ftsup.trainer.checkpoint.comm import LocalComm
from ftsup.trainer.checkpoint.finite import first_nonfinite
from ftsup.trainer.data import GlobalBatchSchedule
from ftsup.trainer.examples.gpt import GPT
from ftsup.trainer.state import TrainingState


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ftsup.tools.bench.checkpoint.finite", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(256, a.seq_len, a.n_layer, 4, a.n_embd, 0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, a.seq_len + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    state = TrainingState(model, optimizer, schedule=GlobalBatchSchedule(1000, 12, 2, 1, 0, 0))
    flat, _ = codec.flatten(codec.state_dicts({"train": state}))
    plan = staging.make_plan(flat, staging.signature(flat), LocalComm())
    buf = None
    stage_s, scan_s = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        buf, _, _ = staging.stage(plan, flat, buf)
        t1 = time.perf_counter()
        if first_nonfinite(plan, buf) is not None:
            raise SystemExit("the reference trainer's state holds a NaN or an infinity")
        stage_s.append(t1 - t0)
        scan_s.append(time.perf_counter() - t1)
    stage, scan = statistics.median(stage_s), statistics.median(scan_s)
    row = {
        "tensor_bytes": plan.tensor_bytes,
        "stage_s": round(stage, 6),
        "finite_check_s": round(scan, 6),
        "check_over_stage": round(scan / stage, 3),
        "gib_per_s": round(plan.tensor_bytes / scan / 2**30, 2),
        "threads": a.threads,
    }
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
