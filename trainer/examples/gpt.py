"""The reference trainer: a small GPT-style language model that resumes exactly.

    torchrun --nproc-per-node 2 -m ftsup.trainer.examples.gpt --steps 200 --ckpt-dir /ckpt --loss-log loss.jsonl
    python -m ftsup.trainer.examples.gpt --steps 50 --ckpt-dir /ckpt          # one process, no torchrun

It trains with AdamW, warmup + cosine LR, dropout and gradient accumulation on a corpus it
generates itself, with DDP or FSDP2 (`--parallel`), on CPU/gloo or CUDA/NCCL (`--device`). It
resumes from the latest consistent checkpoint in `--ckpt-dir` (or `FTSUP_RESUME_STEP`), and
appends one JSON line per optimizer step to `--loss-log` (rank 0):
`{"step", "loss", "loss_hex", "world_size", "samples"}`.

Determinism (on by default): `torch.use_deterministic_algorithms(True)`, one intra-op thread
per rank (`--threads`), every micro-batch's dropout seeded from (seed, step, first global
sample id), and a loss reduced in float64. With these, a resumed run's losses are bitwise
equal to an uninterrupted run's on the same world size, and equal within float reduction
order on another world size.

`--fault KIND@STEP` injects a failure on rank `--fault-rank` for tests and demos: `kill`
(SIGKILL after step STEP), `kill-in-save` (SIGKILL in the background writer while step
STEP's checkpoint is being written), `exit` (exit code 3 after step STEP), `stop` (SIGSTOP
itself after step STEP: a hang).

A periodic save that fails (a full or read-only store) is logged by the engine
(`checkpoint_save_failed`) and training goes on; the previous checkpoint stays the resume point.
An emergency save that fails is logged (`emergency_save_failed`); asked to stop, the trainer then
stops (exit status 1) with the last committed checkpoint as the resume point. A final save that
fails ends the run with exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, cast

import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ftsup.protocol import CHECKPOINT_DIR_ENV
from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointError, CheckpointSaveError, RetentionPolicy
from ftsup.trainer.checkpoint.engine import SaveHandle
from ftsup.trainer.data import DataConfigError, GlobalBatchSchedule, RankBatchSampler
from ftsup.trainer.examples.corpus import TokenWindows, generate
from ftsup.trainer.rng import micro_batch_seed
from ftsup.trainer.runtime import agree, runtime
from ftsup.trainer.state import TrainingState

log = structlog.get_logger("ftsup.trainer")

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
    p.add_argument("--fault", default="", help="KIND@STEP: kill, kill-in-save or exit")
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument(
        "--fault-attempt",
        type=int,
        default=1,
        help="under ftsup run, inject only in this attempt (FTSUP_ATTEMPT) so a restart gets past it; -1: every one",
    )
    args = p.parse_args(argv)
    if not args.ckpt_dir:
        p.error("--ckpt-dir is required (or set FTSUP_CHECKPOINT_DIR)")
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


def _no_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
    if callable(set_sync):
        set_sync(sync)
    return contextlib.nullcontext()


def _fault(args: argparse.Namespace, rank: int, attempt: int) -> tuple[str, int]:
    if not args.fault or (args.fault_attempt >= 0 and attempt not in (0, args.fault_attempt)):
        return "", -1
    kind, _, at = args.fault.partition("@")
    if kind not in ("kill", "kill-in-save", "exit", "stop") or not at.isdigit():
        raise SystemExit(f"--fault must be KIND@STEP with KIND kill, kill-in-save, exit or stop; got {args.fault!r}")
    return (kind, int(at)) if rank == args.fault_rank else ("", -1)


def train(args: argparse.Namespace) -> int:
    rt = runtime()
    rt.beat(rt.env.resume_step or 0, "init")
    rank, world, device = _setup(args)
    fault, fault_step = _fault(args, rank, rt.env.attempt)
    dataset = TokenWindows(generate(args.corpus_bytes), args.seq_len)
    try:
        schedule = GlobalBatchSchedule(len(dataset), args.global_batch, args.micro_batch, world, rank, args.seed)
    except DataConfigError as e:
        print(f"gpt: error: {e}", file=sys.stderr)
        return 2
    config = {
        "vocab": 256, "seq_len": args.seq_len, "n_layer": args.n_layer, "n_head": args.n_head,
        "n_embd": args.n_embd, "dropout": args.dropout, "lr": args.lr, "warmup": args.warmup, "steps": args.steps,
    }  # fmt: skip
    torch.manual_seed(args.seed)  # the same initial weights on every rank and world size
    model: nn.Module = GPT(256, args.seq_len, args.n_layer, args.n_head, args.n_embd, args.dropout).to(device)
    model = _wrap(model, args, world, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(args.warmup, args.steps))

    def hook(point: str, step: int) -> None:
        if fault == "kill-in-save" and point == "shard_written" and step == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)

    engine = CheckpointEngine(args.ckpt_dir, retention=RetentionPolicy(keep_last=args.keep_last), hook=hook)
    state = TrainingState(model, optimizer, scheduler, schedule=schedule, config=config)
    with rt.phase("load"):
        state.resume(engine, at_most=rt.env.resume_step)
    loss_log = open(args.loss_log, "a") if args.loss_log and rank == 0 else None  # noqa: SIM115
    sample_log = open(args.sample_log.replace("{rank}", str(rank)), "a") if args.sample_log else None  # noqa: SIM115
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=RankBatchSampler(schedule, state.step, args.steps), num_workers=args.num_workers
    )
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(loader)
    handled = 0  # the supervisor's save requests already served
    stopped = False
    code = 0
    in_flight: SaveHandle | None = None  # the newest periodic save, to report its duration when it lands
    try:
        for step in range(state.step + 1, args.steps + 1):
            model.train()
            t_start = time.monotonic()
            total = torch.zeros((), dtype=torch.float64, device=device)
            micro = schedule.rank_micro_batches(step)
            for i, mb in enumerate(micro):
                ids, tokens = next(batches)
                if tuple(ids.tolist()) != mb.sample_ids:
                    raise RuntimeError(f"data loader out of step at step {step}: {ids.tolist()} != {mb.sample_ids}")
                tokens = tokens.to(device)
                torch.manual_seed(micro_batch_seed(args.seed, step, mb.first_position))
                with _no_sync(model, i == len(micro) - 1):
                    loss = model(tokens[:, :-1], tokens[:, 1:])
                    (loss / len(micro)).backward()
                total += loss.detach().double()
            if world > 1:
                dist.all_reduce(total)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step, state.samples = step, schedule.position_after(step)
            mean = float(total.item()) / schedule.micro_batches_per_step
            rt.beat(step, "train", loss=mean)
            if loss_log is not None:
                line = {
                    "step": step,
                    "loss": mean,
                    "loss_hex": mean.hex(),
                    "world_size": world,
                    "samples": state.samples,
                }
                loss_log.write(json.dumps(line) + "\n")
                loss_log.flush()
            if sample_log is not None:
                ids_now = [i for mb in micro for i in mb.sample_ids]
                sample_log.write(json.dumps({"step": step, "rank": rank, "world_size": world, "ids": ids_now}) + "\n")
                sample_log.flush()
            if args.min_step_s > 0:
                time.sleep(max(0.0, args.min_step_s - (time.monotonic() - t_start)))
            if in_flight is not None and in_flight.done():
                try:
                    rt.beat(step, "train", save_s=in_flight.wait().durable_s)
                except CheckpointSaveError:
                    pass  # logged and counted by the engine; the previous checkpoint stands, training goes on
                in_flight = None
            if step % args.ckpt_every == 0 and step < args.steps:
                with rt.phase("save", step):  # staging blocks this rank; the write goes on in the background
                    in_flight = cast(SaveHandle, state.save(engine))
                    if args.save_delay_s > 0:
                        time.sleep(args.save_delay_s)
            request = agree(rt.control.poll(), device)  # every rank, every step: one tiny all-reduce
            if request.seq > handled:
                handled = request.seq
                t_save = time.monotonic()
                try:
                    with rt.phase("save", step):
                        state.save(engine, kind="emergency", block=True)
                    rt.beat(step, "train", saved_step=step, save_s=time.monotonic() - t_save)
                except CheckpointSaveError as e:
                    if rank == 0:
                        log.error("emergency_save_failed", step=step, stop=request.stop, reason=str(e))
                    code = 1 if request.stop else 0
                if request.stop:  # evicted: leave; the resume point is this step's checkpoint or the last one
                    stopped = True
                    break
            if step == fault_step and fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if step == fault_step and fault == "exit":
                return 3
            if step == fault_step and fault == "stop":  # a hang: alive, silent, holding its peers
                os.kill(os.getpid(), signal.SIGSTOP)
        if state.step == args.steps and not stopped:
            with rt.phase("save"):
                state.save(engine, kind="final", block=True)
        with rt.phase("save"):
            engine.close()
        rt.beat(state.step, "done")
    finally:
        for f in (loss_log, sample_log):
            if f is not None:
                f.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def main(argv: list[str] | None = None) -> int:
    try:
        return train(parse_args(argv))
    except CheckpointSaveError as e:  # the final save: training is done, its result is not saved
        print(f"gpt: error: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:  # a refused checkpoint: say why in one line, take no step
        print(f"gpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    # Everything is closed and committed by now; skip the interpreter's teardown of torch, which
    # takes seconds here and would only delay a restart or an eviction.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
