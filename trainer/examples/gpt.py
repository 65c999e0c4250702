"""The reference trainer: a small GPT-style language model that resumes exactly.

`python -m ftsup.trainer.examples.gpt`, alone or under torchrun: its flags, loss log, determinism, faults and exit
statuses are docs/adopting.md's (The reference trainer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ftsup import CheckpointEngine, RetentionPolicy, Session, runtime
from ftsup.protocol import CHECKPOINT_DIR_ENV, parse_data_skips
from ftsup.trainer.checkpoint import CheckpointError, CheckpointSaveError
from ftsup.trainer.data import DataConfigError
from ftsup.trainer.examples import faults
from ftsup.trainer.examples.corpus import TokenWindows, generate

# ---------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.out = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class WarmupCosine:
    """LR multiplier: linear warmup, then cosine decay to `floor` (a callable object, so
    LambdaLR saves its settings in the checkpoint)."""

    def __init__(self, warmup: int, total: int, floor: float = 0.1):
        self.warmup = warmup
        self.total = total
        self.floor = floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------- training


def evaluate(model: nn.Module, dataset: TokenWindows, args: argparse.Namespace, device: torch.device) -> float:
    """The mean loss over the last `--eval-batches` micro-batches of windows, the model in eval mode (no dropout, no
    randomness drawn: training after it is the same as without it)."""
    model.eval()
    n = args.eval_batches * args.micro_batch
    windows = torch.stack([dataset[i][1] for i in range(len(dataset) - n, len(dataset))]).to(device)
    with torch.no_grad():
        losses = [model(w[:, :-1], w[:, 1:]) for w in windows.split(args.micro_batch)]
    if args.eval_pad_s > 0:
        time.sleep(args.eval_pad_s)  # an evaluation that takes its time
    return float(torch.stack(losses).mean())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ftsup.trainer.examples.gpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-dir", default=os.environ.get(CHECKPOINT_DIR_ENV))
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-log")
    p.add_argument("--sample-log", help="per-rank JSON lines of sample ids; '{rank}' in the path is replaced")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--corpus-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="pad each step to at least this long (demos and tests that need time to act; no effect on the math)",
    )
    p.add_argument(
        "--save-delay-s",
        type=float,
        default=0.0,
        help="block each periodic save this much longer (tests of long saves; no effect on the math)",
    )
    p.add_argument("--clip-grad-norm", type=float, help="clip the gradients to this norm (default: no clipping)")
    p.add_argument(
        "--init-from-hf",
        metavar="DIR",
        help=(
            "a fresh run starts from this Hugging Face model directory's weights "
            "(model.safetensors, or its index and shards; each rank reads its share)"
        ),
    )
    p.add_argument(
        "--init-from-dcp",
        metavar="DIR",
        help="a fresh run starts from this DCP checkpoint's weights (torch's, torchtitan's: DIR/step-N or the newest)",
    )
    p.add_argument("--skip", default="", help="A:B,C:D: global data positions never served (with FTSUP_DATA_SKIPS)")
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="every N steps rank 0 alone evaluates while the other ranks wait for it in the next step (0: never)",
    )
    p.add_argument("--eval-batches", type=int, default=4, help="micro-batches of the held-out windows per evaluation")
    p.add_argument("--eval-pad-s", type=float, default=0.0, help="make each evaluation last this much longer")
    p.add_argument(
        "--fault",
        default="",
        help="kill@STEP, kill-in-save@STEP, exit@STEP, stop@STEP, nan@STEP[:RANK], spike@STEP:LEN or slow@RANK:FACTOR",
    )
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument(
        "--fault-file",
        help=(
            "a JSON file through which chaos tooling asks one rank (by pid) to exit 3 "
            "or to die in its next commit (faults.Trigger)"
        ),
    )
    p.add_argument(
        "--fault-attempt",
        type=int,
        default=1,
        help="under ftsup run, inject only in this attempt (FTSUP_ATTEMPT) so a restart gets past it; -1: every one",
    )
    args = p.parse_args(argv)
    if not args.ckpt_dir:
        p.error("--ckpt-dir is required (or set FTSUP_CHECKPOINT_DIR)")
    if args.eval_every and args.parallel == "fsdp":
        p.error("--eval-every: rank 0 evaluates alone, which a model sharded over the ranks (--parallel fsdp) cannot")
    try:
        args.skip = parse_data_skips(args.skip, "--skip")
    except ValueError as e:
        p.error(str(e))
    return args


def _setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


def _wrap(model: nn.Module, args: argparse.Namespace, world: int, device: torch.device) -> nn.Module:
    if world == 1 and not dist.is_initialized():
        return model
    if args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def train(args: argparse.Namespace) -> int:
    rt = runtime()
    rt.beat(rt.env.resume_step or 0, "init")
    rank, world, device = _setup(args)
    fault = faults.parse(args.fault, args.fault_rank, rt.env.attempt, args.fault_attempt)
    kind, fault_step = fault.process_fault(rank)
    poison = faults.Poison(fault, args.global_batch, args.seed, rank)
    trigger = faults.Trigger(args.fault_file)
    dataset = TokenWindows(generate(args.corpus_bytes), args.seq_len)
    config = {
        "vocab": 256,
        "seq_len": args.seq_len,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_embd": args.n_embd,
        "dropout": args.dropout,
        "lr": args.lr,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    torch.manual_seed(args.seed)  # the same initial weights on every rank and world size
    model: nn.Module = GPT(256, args.seq_len, args.n_layer, args.n_head, args.n_embd, args.dropout).to(device)
    model = _wrap(model, args, world, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(args.warmup, args.steps))

    def hook(point: str, step: int) -> None:
        if (kind == "kill-in-save" and point == "shard_written" and step == fault_step) or trigger.kills_at(point):
            os.kill(os.getpid(), signal.SIGKILL)
        if args.save_delay_s > 0 and point == "staged" and step % args.ckpt_every == 0 and step < args.steps:
            time.sleep(args.save_delay_s)  # a periodic save that blocks this much longer, in phase save

    engine = CheckpointEngine(args.ckpt_dir, retention=RetentionPolicy(keep_last=args.keep_last), hook=hook)
    session = Session(
        model,
        optimizer,
        scheduler,
        dataset,
        global_batch=args.global_batch,
        seed=args.seed,
        micro_batch=args.micro_batch,
        config=config,
        save_every=args.ckpt_every,
        engine=engine,
        num_workers=args.num_workers,
        skip=args.skip,
        init_from_hf=args.init_from_hf,
        init_from_dcp=args.init_from_dcp,
    )
    loss_log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None  # noqa: SIM115
    sample_log = open(args.sample_log.replace("{rank}", str(rank)), "a") if args.sample_log else None  # noqa: SIM115
    first = session.step + 1
    try:
        for step in session.steps(args.steps):
            if step - 1 == fault_step and step > first:  # after step STEP, its save and the requests it read
                code = faults.inject(kind)
                if code is not None:
                    return code
            asked = trigger.poll()
            if asked and (code := faults.inject(asked)) is not None:
                return code
            model.train()
            t_start = time.monotonic()
            total = torch.zeros((), dtype=torch.float64, device=device)
            ids_now: list[int] = []
            t_micro = time.monotonic()  # a micro-batch's time includes its fetch, so a slowed one is slow whole
            for ids, tokens in session.micro_batches():
                mb = session.micro_batch
                want = mb.sample_ids if mb else ()
                if tuple(ids.tolist()) != want:
                    raise RuntimeError(f"data loader out of step at step {step}: {ids.tolist()} != {want}")
                ids_now += want
                positions = mb.positions if mb else ()
                tokens = poison.tokens(positions, tokens).to(device, non_blocking=True)  # no wait: one per step
                loss = poison.loss(positions, model(tokens[:, :-1], tokens[:, 1:]))
                (loss / session.accumulation_steps).backward()
                total += loss.detach().double()
                poison.slow_down(time.monotonic() - t_micro)
                t_micro = time.monotonic()
            # this rank's loss; the guard's one copy to the host brings it and the mean over the ranks
            check = session.clip_and_step(args.clip_grad_norm, total / session.accumulation_steps)
            mean = check.mean_loss
            if loss_log is not None:
                line = {
                    "step": step,
                    "loss": mean,
                    "loss_hex": mean.hex(),
                    "world_size": world,
                    "samples": session.schedule.position_after(step),
                }
                if check.refused:
                    line["step_skipped"] = True
                loss_log.write(json.dumps(line) + "\n")
                loss_log.flush()
            if sample_log is not None:
                sample_log.write(json.dumps({"step": step, "rank": rank, "world_size": world, "ids": ids_now}) + "\n")
                sample_log.flush()
            if args.min_step_s > 0:
                time.sleep(max(0.0, args.min_step_s - (time.monotonic() - t_start)))
            if args.eval_every and step % args.eval_every == 0 and step < args.steps and rank == 0:
                # Rank 0 alone: the other ranks go on into the next step and wait for it in its all-reduce, which the
                # supervisor tells from a hang while this rank is in phase eval (no barrier needed).
                plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
                with session.phase("eval"):
                    held_out = evaluate(plain, dataset, args, device)
                print(json.dumps({"eval_step": step, "eval_loss": held_out}), flush=True)
    finally:
        for f in (loss_log, sample_log):
            if f is not None:
                f.close()
    return 0  # the process groups stay: __main__ leaves without tearing them down


def main(argv: list[str] | None = None) -> int:
    try:
        return train(parse_args(argv))
    except CheckpointSaveError as e:  # the final save: training is done, its result is not saved
        print(f"gpt: error: {e}", file=sys.stderr)
        return 1
    except (CheckpointError, DataConfigError) as e:  # a refused checkpoint or batch: one line, no step
        print(f"gpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    # Everything is closed and committed by now; skip the interpreter's teardown of torch, which
    # takes seconds here and would only delay a restart or an eviction (and in which a gloo group's
    # destructor, joining its threads while holding the GIL, now and then deadlocks with one of them).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
