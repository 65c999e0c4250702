"""One training step of a transformers GPT-2 started from a Hugging Face model directory by `Session(init_from_hf=)`,
alone or under torchrun with FSDP2.

    hf_gpt2_run.py --hf DIR --ckpt-dir DIR --out FILE

The model is built from DIR's config.json with weights of its own (seed 0), sharded with `fully_shard` (each block,
then the whole) when there are several ranks, and trained one step of 4 samples of the reference corpus in
micro-batches of 2. Writes FILE.<rank>.json: the step's loss (the mean over ranks), the sample ids of each of this
rank's micro-batches, this rank's share of the model (the bytes of its local tensors, tied ones once), the bytes the
Session's loader says it read, and, for a second load of DIR after the step (`TrainingState.init_from_hf`, everything
imported by then), the bytes this process read (`rchar` of /proc/self/io: the kernel's count of every read call),
the bytes of the files' headers and the number of tensors read.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, cast

import torch
import torch.distributed as dist

from ftsup import Session
from ftsup.store import hublayout
from ftsup.trainer.examples.corpus import TokenWindows, generate

SEQ_LEN = 32
CORPUS_BYTES = 65536


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def share(model: torch.nn.Module) -> int:
    """Bytes of this rank's part of the model's state dict, a tensor shared by two names counted once."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        local = cast(Any, t).to_local() if type(t).__name__ == "DTensor" else t
        if local.data_ptr() not in seen:
            seen.add(local.data_ptr())
            total += local.nbytes
    return total


def main() -> None:
    import argparse

    from transformers import AutoConfig, AutoModelForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    rank, world = 0, 1
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = TokenWindows(generate(CORPUS_BYTES), SEQ_LEN)
    session = Session(
        model,
        optimizer,
        None,
        dataset,
        global_batch=4,
        micro_batch=2,
        ckpt_dir=args.ckpt_dir,
        save_every=None,
        init_from_hf=args.hf,
    )
    assert session.hf_init is not None
    batches: list[list[int]] = []
    loss = None
    for _ in session.steps(1):
        total = torch.zeros((), dtype=torch.float64)
        for ids, tokens in session.micro_batches():
            batches.append(ids.tolist())
            out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
            (out.loss / session.accumulation_steps).backward()
            total += out.loss.detach().double()
        loss = session.clip_and_step(1.0, total / session.accumulation_steps).mean_loss
    session.close()
    before = rchar()
    session.state.init_from_hf(args.hf)
    read = rchar() - before
    result = {
        "loss": loss,
        "micro_batches": batches,
        "share": share(model),
        "bytes_read": session.hf_init.bytes_read,
        "rchar": read,
        "header_bytes": hublayout.read(args.hf).header_bytes,
        "world_size": world,
        "tensors": session.hf_init.origin["tensors"],
    }
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # no torch teardown: see ftsup.trainer.examples.gpt (tearing a gloo group down can hang)


if __name__ == "__main__":
    main()
