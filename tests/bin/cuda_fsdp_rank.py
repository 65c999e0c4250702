"""One CUDA rank under torchrun (NCCL): `torchrun --nproc-per-node 1 cuda_fsdp_rank.py --dir D --out FILE`.

FSDP2 over a one-GPU mesh with `ckpt_worker.py`'s model and steps, saved by the engine while training goes on, so that
`ckpt_worker.py load` (CPU, gloo, any world size) loads it; writes the digests of the state at the save and the request
the Session's agreement (a gloo group beside NCCL) agreed on."""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ftsup.trainer.checkpoint import CheckpointEngine, RetentionPolicy
from ftsup.trainer.checkpoint.stateful import ModelOptimState
from ftsup.trainer.runtime import Agreement, runtime


def build(device: torch.device, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 4),
    ).to(device)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in layers:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(layers, mesh=mesh)
    return layers, torch.optim.AdamW(layers.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g).to(device)
    y = torch.randn(8, 4, generator=g).to(device)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    optim.zero_grad()


def digests(state: ModelOptimState) -> dict[str, str]:
    out = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            full = obj.full_tensor() if hasattr(obj, "full_tensor") else obj
            raw = full.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            out[prefix] = hashlib.sha256(raw).hexdigest()

    walk("", state.state_dict())
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--width", type=int, default=96)
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    agreement = Agreement()  # a gloo group of its own beside the NCCL one, as in a Session
    agreement.start(runtime().control.poll())
    model, optim = build(device, args.width)
    state = ModelOptimState(model, optim)
    engine = CheckpointEngine(args.dir, retention=RetentionPolicy(keep_last=10), durable_tier=None)
    for step in (1, 2):
        train_step(model, optim, step, device)
    saved = digests(state)
    rank_state = {"rank": dist.get_rank(), "step": 2}
    handle = engine.save(2, {"app": state}, rank_state=rank_state, metadata={"global_batch": 8})
    for step in range(3, 6):  # training goes on while the copy and the write are in flight
        train_step(model, optim, 10_000 + step, device)
    handle.wait()
    after = digests(state)
    request = agreement.wait()
    agreement.close()
    engine.close()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"digests": saved, "changed_after": after != saved, "agreed_seq": request.seq}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
