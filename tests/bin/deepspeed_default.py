"""A DeepSpeed script as it is written without ftsup: its own loop over `deepspeed.initialize`'s engine (a small MLP
built from its sizes, AdamW, ZeRO stage --stage), `load_checkpoint(--save-dir)` at the start and `save_checkpoint`
every --save-every steps, on CPU with DeepSpeed's CPU accelerator and gloo.

    deepspeed_default.py --loss-log FILE --save-dir DIR [--stage 1|2|3] [--steps N] [--save-every K] [--pause-s S]
                         [--width W] [--depth D] [--client-state]

Each step's batch is a function of the step alone, so a run resumed from step N computes the losses of one that never
stopped. Rank 0 appends `{"step", "loss_hex"}` to the loss log after each optimizer step; `--pause-s` sleeps after each
step, so that a test can act mid-run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loss-log", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=1, help="hidden width x width layers")
    p.add_argument(
        "--client-state", action="store_true", help="save the loop's step in client_state, as DeepSpeed's tutorial"
    )
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    hidden = [m for _ in range(args.depth) for m in (torch.nn.Linear(args.width, args.width), torch.nn.GELU())]
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.width), torch.nn.GELU(), *hidden, torch.nn.Linear(args.width, 4)
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.load_checkpoint(args.save_dir)
    rank = engine.global_rank
    while engine.global_steps < args.steps:
        g = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        torch.distributed.all_reduce(reduced)
        if rank == 0:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"step": engine.global_steps, "loss_hex": float(reduced.item()).hex()}) + "\n")
        if engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(
                args.save_dir, client_state={"step": engine.global_steps} if args.client_state else {}
            )
        time.sleep(args.pause_s)


if __name__ == "__main__":
    main()
