"""Three ranks (CPU, gloo) under torchrun that read what tests/bin/dcp_save_worker.py wrote, each its share.

    dcp_load_worker.py --dcp DIR --export DIR --out FILE

Builds the reference GPT (seed 0) under FSDP2, loads DIR with `load_dcp_model`, then loads the export DIR with
`torch.distributed.checkpoint.load` into plain tensors of the shapes its metadata gives (torch's own reader), and
writes FILE.<rank>.json: SHA-256 of every full tensor of each, the bytes this rank read and its share; or, when
loading failed, the error's message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ftsup.store.errors import CheckpointError
from ftsup.trainer.dcp.load import load_dcp_model
from ftsup.trainer.examples.gpt import GPT

SHAPE = {"seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}  # dcp_save_worker.py's


def digest(t: Any) -> str:
    full = t.full_tensor() if type(t).__name__ == "DTensor" else t
    return hashlib.sha256(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dcp", required=True)
    p.add_argument("--export", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(256, dropout=0.0, **SHAPE)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out: dict[str, Any] = {}
    try:
        result = load_dcp_model(model, args.dcp)
        out["digests"] = {k: digest(v) for k, v in model.state_dict().items()}
        out["share"] = sum(v.to_local().nbytes for v in model.state_dict().values())
        out |= {"bytes_read": result.bytes_read, "structure": result.structure_bytes_read, "origin": result.origin}
    except CheckpointError as e:
        out["error"] = str(e)
    meta = dcp.FileSystemReader(args.export).read_metadata()
    sd = {
        k: torch.full(tuple(m.size), 7, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, checkpoint_id=args.export)
    out["export"] = {k: digest(v) for k, v in sd.items()}
    with open(f"{args.out}.{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # no torch teardown: see ftsup.trainer.examples.gpt (tearing a gloo group down can hang)


if __name__ == "__main__":
    main()
