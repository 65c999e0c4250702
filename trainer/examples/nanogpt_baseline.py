"""A minimal GPT training script in the style of nanoGPT's train.py (`nanogpt_baseline.py`), and the same adopted with
ftsup (`nanogpt.py`): a script, not a module to import. Random windows of a token memmap, gradient accumulation,
rank 0 alone evaluating; DDP on gloo under torchrun. Settings are globals, overridden as `--key=value`.
Data: uint16 tokens in `{data_dir}/train.bin` and `val.bin` (docs/adopting.md, A loop of its own).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from ast import literal_eval
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd, bias=config.bias), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd, bias=config.bias), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std) if p.dim() >= 2 else nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float]):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


# -----------------------------------------------------------------------------
# default config values
out_dir = "out"
data_dir = "data"
loss_log = ""  # rank 0 appends one JSON line per iteration: the loss as float.hex, and the evaluation's
eval_interval = 10
log_interval = 1
eval_iters = 4
always_save_checkpoint = False
gradient_accumulation_steps = 4
batch_size = 4
block_size = 64
vocab_size = 256
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.1
bias = True
learning_rate = 1e-3
max_iters = 40
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 5
lr_decay_iters = 100
min_lr = 1e-4
min_iter_s = 0.0  # pad each iteration to at least this long (to aim a fault at a step; no effect on the math)
min_eval_s = 0.0  # pad each evaluation to at least this long, as a larger held-out set would (no effect on the math)
backend = "gloo"
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
for arg in sys.argv[1:]:  # --key=value, as nanoGPT's configurator.py reads it
    key, _, val = arg.removeprefix("--").partition("=")
    if key not in config_keys:
        sys.exit(f"unknown config key: {key}")
    try:
        value = literal_eval(val)
    except (SyntaxError, ValueError):
        value = val
    if type(value) is not type(globals()[key]):
        sys.exit(f"{key} takes a {type(globals()[key]).__name__}, not {val!r}")
    globals()[key] = value
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------

ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank  # each process gets a different seed
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}", flush=True)
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
ctx = nullcontext()


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    # recreate np.memmap every batch to avoid a memory leak
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x, y


iter_num = 0
best_val_loss = 1e9
model_args: dict[str, Any] = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias)
model_args |= dict(vocab_size=vocab_size, dropout=dropout)
model: Any = GPT(GPTConfig(**model_args))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
model = DDP(model) if ddp else model


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out, start = {}, time.time()
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    time.sleep(max(0.0, min_eval_s - (time.time() - start)))  # a larger held-out set's time, in the evaluation
    model.train()
    return out


def get_lr(it: int) -> float:
    if it < warmup_iters:  # 1) linear warmup for warmup_iters steps
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:  # 2) if it > lr_decay_iters, return min learning rate
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)  # 3) in between, cosine decay down to min lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


# training loop
X, Y = get_batch("train")  # fetch the very first batch
t0 = time.time()
local_iter_num = 0  # number of iterations in the lifetime of this process
raw_model = model.module if ddp else model  # unwrap DDP container if needed
while True:
    # determine and set the learning rate for this iteration
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    # evaluate the loss on train/val sets and write checkpoints
    losses = {}
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(checkpoint | {"iter_num": iter_num, "config": config}, os.path.join(out_dir, "ckpt.pt"))

    # forward backward update, with gradient accumulation to simulate a larger batch size
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
        # immediately prefetch the next batch while the model does the forward pass
        X, Y = get_batch("train")
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    # timing and logging
    time.sleep(max(0.0, min_iter_s - (time.time() - t0)))
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms", flush=True)
        if loss_log:
            line = {"step": iter_num, "loss": lossf, "loss_hex": lossf.hex(), "world_size": ddp_world_size}
            with open(loss_log, "a") as f:
                f.write(json.dumps(line | {f"{k}_hex": v.hex() for k, v in losses.items()}) + "\n")
    iter_num += 1
    local_iter_num += 1
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
sys.stdout.flush()
os._exit(0)  # no interpreter teardown: a gloo group's threads can deadlock it now and then
