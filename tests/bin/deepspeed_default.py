"""A DeepSpeed script as it is written without ftsup: its own loop over `deepspeed.initialize`'s engine (a small MLP
built from its sizes, AdamW, ZeRO stage --stage), `load_checkpoint(--save-dir)` at the start and `save_checkpoint`
every --save-every steps, on CPU with DeepSpeed's CPU accelerator and gloo.

    deepspeed_default.py --loss-log FILE --save-dir DIR [--stage 1|2|3] [--steps N] [--save-every K] [--pause-s S]
                         [--width W] [--depth D] [--client-state] [--die-in-save STEP]

Each step's batch is a function of the step alone, so a run resumed from step N computes the losses of one that never
stopped. Rank 0 appends `{"step", "loss_hex"}` to the loss log after each optimizer step; `--pause-s` sleeps after each
step, so that a test can act mid-run. `--die-in-save STEP` (a test's fault, once: a file `died-in-save` marks it done)
SIGKILLs rank 1 halfway through writing its optimizer states in the save of STEP, as a kill in a save leaves a tag.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

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
    p.add_argument("--die-in-save", type=int, help="rank 1 SIGKILLed in the middle of this step's save, once")
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
    if args.die_in_save is not None and rank == 1 and not Path("died-in-save").exists():
        die_in_save(lambda: engine.global_steps == args.die_in_save)
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


def die_in_save(now: Any) -> None:
    """torch.save of this rank's optimizer states, when `now()`: half its bytes written, then (once rank 0's `latest`
    names the tag, as it does without waiting for the other ranks) SIGKILL."""
    original = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(f, str | os.PathLike) and str(f).endswith("optim_states.pt") and now()):
            return original(obj, f, *args, **kwargs)
        Path("died-in-save").touch()
        data = io.BytesIO()
        original(obj, data, *args, **kwargs)
        with open(f, "wb") as out:
            out.write(data.getvalue()[: len(data.getvalue()) // 2])
        latest, deadline = Path(f).parent.parent / "latest", time.monotonic() + 60
        while time.monotonic() < deadline and not (latest.exists() and latest.read_text() == Path(f).parent.name):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


if __name__ == "__main__":
    main()
