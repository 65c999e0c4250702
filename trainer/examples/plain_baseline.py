"""A plain PyTorch training script (`plain_baseline.py`), and the same adopted with ftsup (`plain.py`).

A tiny GPT-2 trained with DDP on gloo; the two files differ only in the lines that adopt `ftsup.Session`, which the
README shows (docs/design/trainer.md, The examples).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

WORDS = "the a rank node model shard step loss saves loads resumes watches before after quickly".split()


class Text(Dataset):
    """Windows of `seq_len` byte tokens of generated sentences; item i is {"id": i, "input_ids": ...}."""

    def __init__(self, n_bytes: int, seq_len: int, seed: int):
        rnd = random.Random(seed)
        text = " ".join(rnd.choice(WORDS) for _ in range(n_bytes // 4)).encode()[:n_bytes]
        self.tokens = torch.tensor(list(text), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"id": i, "input_ids": self.tokens[i * self.seq_len : (i + 1) * self.seq_len]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--min-eval-s", type=float, default=0.0)
    p.add_argument("--loss-log")
    p.add_argument("--sample-log", help="per-rank JSON lines of sample ids per step; '{rank}' is replaced")
    p.add_argument("--logits-out", help="rank 0, at the end: the model's logits on a fixed input (torch.save)")
    return p.parse_args()


def evaluate(model: torch.nn.Module, loader: DataLoader, batches: int, min_s: float) -> float:
    model.eval()
    start, total = time.monotonic(), torch.zeros(2, dtype=torch.float64)
    for batch in itertools.islice(loader, batches):
        total += torch.tensor([model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.item(), 1.0])
    time.sleep(max(0.0, min_s - (time.monotonic() - start)))
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = DistributedDataParallel(GPT2LMHeadModel(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    dataset, held_out = Text(1 << 18, args.seq_len, seed=1), Text(1 << 14, args.seq_len, seed=2)
    gb, mb, every = args.global_batch, args.micro_batch, args.eval_every
    eval_loader = DataLoader(held_out, mb, sampler=DistributedSampler(held_out, shuffle=False))
    accum = gb // (mb * world)
    batches = iter(DataLoader(dataset, mb, sampler=DistributedSampler(dataset, seed=0), drop_last=True))
    loss_log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None  # noqa: SIM115
    sample_log = open(args.sample_log.replace("{rank}", str(rank)), "a") if args.sample_log else None  # noqa: SIM115
    for step in range(1, args.steps + 1):
        total, ids = torch.zeros((), dtype=torch.float64), []
        for batch in itertools.islice(batches, accum):
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            (loss / accum).backward()
            total += loss.detach().double()
            ids += batch["id"].tolist()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        mean = float(total) / (accum * world)
        if loss_log:
            line = {"step": step, "loss": mean, "loss_hex": mean.hex(), "world_size": world}
            loss_log.write(json.dumps(line | {"samples": step * gb, "grad_norm": float(grad_norm)}) + "\n")
            loss_log.flush()
        if sample_log:
            sample_log.write(json.dumps({"step": step, "rank": rank, "ids": ids}) + "\n")
            sample_log.flush()
        if step % every == 0:
            start = time.monotonic()
            with torch.no_grad():
                eval_loss = evaluate(model, eval_loader, args.eval_batches, args.min_eval_s)
            if rank == 0:
                took = time.monotonic() - start
                print(json.dumps({"eval_step": step, "eval_loss": eval_loss, "eval_s": took}), flush=True)
    if args.logits_out and rank == 0:
        model.module.eval()
        with torch.no_grad():
            torch.save(model.module(torch.arange(args.seq_len).unsqueeze(0) % 256).logits, args.logits_out)


if __name__ == "__main__":
    main()
    # Every file is flushed. Leave without torch's teardown: a gloo group's destructor joins its
    # threads holding the GIL, which one of them may be waiting for (a deadlock, now and then).
    os._exit(0)
