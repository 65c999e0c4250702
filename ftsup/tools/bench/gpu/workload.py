"""The GPU rows' training job: transformer-like MLP blocks in fp32 with AdamW, sized to a state's bytes (at width 2048
a block is 0.6 GB of state: 12 GB is 20 blocks, about 1B parameters in 960 tensors), trained in bf16 autocast; each
step reads its loss on the host once, as a step guard does, before its optimizer step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(q * torch.sigmoid(k) + v)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def block_bytes(d: int) -> int:
    """State bytes of one block: fp32 parameters and AdamW's two fp32 moments."""
    return 12 * (12 * d * d + 13 * d)


class Workload:
    """The model, its optimizer (stepped once, so its moments exist) and a batch, on `device`."""

    def __init__(self, target_bytes: int, d: int, tokens: int, device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.blocks = max(1, round(target_bytes / block_bytes(d)))
        with device:  # made and initialised where it trains: tens of GB need not pass through the host
            self.model = nn.Sequential(*(Block(d) for _ in range(self.blocks)))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)
        self.x = torch.randn(tokens, d, device=device)
        self.before_update: Callable[[], None] | None = None
        """Called once before the next optimizer step, then cleared (DCP's wait for its staging)."""
        self.step()

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def step(self) -> float:
        cuda = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = self.model(self.x).float().square().mean()
        loss.backward()
        value = loss.item()
        if self.before_update is not None:
            wait, self.before_update = self.before_update, None
            wait()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def state_bytes(sd: Any) -> tuple[int, int]:
    """(bytes, tensors) of a state dict's tensors."""
    total = count = 0
    stack = [sd]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, torch.Tensor):
            total += node.numel() * node.element_size()
            count += 1
    return total, count


def fingerprint(sd: Any) -> list[int]:
    """An exact fingerprint of every tensor (integer sums of its 32-bit words, weighted by position mod 7), computed
    where the tensor is: equal fingerprints before a save and after a load say the bytes came back."""
    out = []
    stack = [sd]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node[k] for k in sorted(node, key=str))
        elif isinstance(node, torch.Tensor):
            flat = node.detach().reshape(-1).view(torch.uint8)
            words = flat[: flat.numel() // 4 * 4].view(torch.int32).to(torch.int64)
            weights = torch.arange(words.numel(), device=words.device) % 7 + 1
            tail = flat[flat.numel() // 4 * 4 :].to(torch.int64).sum()
            out.append(int((words * weights).sum() + tail))
    return out
