"""Two FSDP2 ranks (CPU, gloo) under torchrun that write what the DCP interop tests read.

    dcp_save_worker.py --out DIR

DIR/dcp/step-5 and DIR/dcp/step-10: the reference GPT's weights (seed 1; then each parameter plus 0.25) saved by
`torch.distributed.checkpoint.save` as torchtitan saves a model (its state dict's names at the top level, and a
`train_state` value beside them); DIR/ftsup/step-000000001: an ftsup checkpoint of that model and its AdamW state
after one step. DIR/ref.json (rank 0): SHA-256 of every full tensor of step-10's model (`dcp`) and of the ftsup
checkpoint's tensors under their names in it (`ftsup`).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ftsup import TrainingState
from ftsup.trainer.checkpoint import CheckpointEngine
from ftsup.trainer.examples.gpt import GPT

SHAPE = {"seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def digest(t: Any) -> str:
    full = t.full_tensor() if type(t).__name__ == "DTensor" else t
    return hashlib.sha256(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = GPT(256, dropout=0.0, **SHAPE)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train_state = io.BytesIO(b"step 5")
    dcp.save({**model.state_dict(), "train_state": train_state}, checkpoint_id=str(args.out / "dcp" / "step-5"))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.25)
    dcp.save({**model.state_dict(), "train_state": train_state}, checkpoint_id=str(args.out / "dcp" / "step-10"))
    ref: dict[str, dict[str, str]] = {"dcp": {k: digest(v) for k, v in model.state_dict().items()}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(param.sum() for param in model.parameters()).backward()  # type: ignore[union-attr]
    optimizer.step()
    state = TrainingState(model, optimizer)
    state.step = 1
    with CheckpointEngine(args.out / "ftsup") as engine:
        state.save(engine, kind="final", block=True)
    names: dict[Any, str] = {param: name for name, param in model.named_parameters()}
    ref["ftsup"] = {f"train.model.{k}": digest(v) for k, v in model.state_dict().items()}
    for owner, values in optimizer.state.items():
        ref["ftsup"] |= {f"train.optim.state.{names[owner]}.{k}": digest(v) for k, v in values.items()}
    if dist.get_rank() == 0:
        (args.out / "ref.json").write_text(json.dumps(ref))
    sys.stdout.flush()
    os._exit(0)  # no torch teardown: see ftsup.trainer.examples.gpt (tearing a gloo group down can hang)


if __name__ == "__main__":
    main()
