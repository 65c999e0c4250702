"""A rank that starts the reference trainer's model from a Hugging Face model directory, under torchrun or alone.

    hf_init_worker.py --hf DIR --parallel ddp|fsdp|none --out FILE

Builds the reference GPT (its own initial values, seed 0), wraps it (DDP, FSDP2, or not), loads DIR with
`load_hf_model` and writes FILE.<rank>.json: SHA-256 of every full (unsharded) tensor of the model's state
dict, the bytes this rank read and the origin; or, when loading failed, the error's message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any, cast

import torch
import torch.distributed as dist

from ftsup.store.errors import CheckpointError
from ftsup.trainer.examples.gpt import GPT
from ftsup.trainer.hf.load import load_hf_model

SHAPE = {"seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}


def digest(t: torch.Tensor) -> str:
    full = cast(Any, t).full_tensor() if type(t).__name__ == "DTensor" else t
    return hashlib.sha256(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--parallel", choices=["ddp", "fsdp", "none"], default="none")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = 0
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model: torch.nn.Module = GPT(256, dropout=0.0, **SHAPE)
    if args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif args.parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    try:
        result = load_hf_model(model, args.hf)
        inner = cast(torch.nn.Module, model.module) if args.parallel == "ddp" else model
        out = {
            "digests": {k: digest(v) for k, v in inner.state_dict().items()},
            "bytes_read": result.bytes_read,
            "origin": result.origin,
        }
    except CheckpointError as e:
        out = {"error": str(e)}
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # no torch teardown: see ftsup.trainer.examples.gpt (tearing a gloo group down can hang)


if __name__ == "__main__":
    main()
