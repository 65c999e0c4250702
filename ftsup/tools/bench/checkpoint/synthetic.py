"""The benchmark's synthetic training state, inside a rank with `torch.distributed` initialised: Linear layers
sharded on dim 0 with `fully_shard` over a CPU mesh, sized so that parameters and AdamW's two moments add up to the
requested MiB, after one real optimizer step; the two kinds of training step stalls are measured with; and a
checksum of the full state for exactness checks. No I/O.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ftsup.tools.bench.checkpoint.shape import ModelShape


class AppState(Stateful):
    """Model and optimizer as one Stateful, the way DCP's documentation recommends."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model = model
        self.optim = optim

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


@dataclass
class Synthetic:
    """A built model on this rank, with its optimizer and a reusable input batch."""

    shape: ModelShape
    model: nn.Module
    optim: torch.optim.Optimizer
    batch: torch.Tensor

    @property
    def app(self) -> AppState:
        return AppState(self.model, self.optim)

    def state(self) -> dict[str, Any]:
        """What every checkpointer is handed: one Stateful under one name."""
        return {"app": self.app}

    def model_step(self) -> None:
        """One forward, backward and AdamW step (collectives on the default group)."""
        out = self.model(self.batch)
        out.float().pow(2).mean().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)


def build(shape: ModelShape, world_size: int, batch: int = 4, seed: int = 0) -> Synthetic:
    """Build, shard and take one optimizer step, so that exp_avg/exp_avg_sq exist."""
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world_size,))
    layers: list[nn.Module] = []
    for _ in range(shape.layers):
        layers.append(nn.Linear(shape.width, shape.width))
    model = nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    syn = Synthetic(shape, model, optim, torch.randn(batch, shape.width))
    syn.model_step()
    return syn


def iter_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) pairs of a nested dict/list, in a rank-independent order."""
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from iter_leaves(obj[key], f"{prefix}{key}.")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from iter_leaves(item, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), obj


def local_tensors(state_dict: dict[str, Any]) -> list[torch.Tensor]:
    """This rank's tensors: the local shard of each DTensor, plain tensors as they are."""
    out = []
    for _, leaf in iter_leaves(state_dict):
        if isinstance(leaf, DTensor):
            out.append(leaf.to_local())
        elif isinstance(leaf, torch.Tensor):
            out.append(leaf)
    return out


def local_bytes(state_dict: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(state_dict))


def zero_(state_dict: dict[str, Any]) -> None:
    """Overwrite every local tensor so that a load has something to prove."""
    with torch.no_grad():
        for t in local_tensors(state_dict):
            t.zero_()


def full_checksum(state_dict: dict[str, Any]) -> str | None:
    """blake2b over key, dtype, shape and bytes of every full tensor; rank 0 gets it.

    Collective (DTensor.full_tensor() all-gathers): every rank must call it. Only tensors
    count: the saved values are what a load must reproduce bitwise.
    """
    digest = hashlib.blake2b(digest_size=16) if dist.get_rank() == 0 else None
    for key, leaf in iter_leaves(state_dict):
        if not isinstance(leaf, torch.Tensor):
            continue
        full = leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
        if digest is not None:
            full = full.detach().contiguous()
            digest.update(f"{key}|{full.dtype}|{tuple(full.shape)}".encode())
            digest.update(full.reshape(-1).view(torch.uint8).numpy().data)
        del full
    return digest.hexdigest() if digest is not None else None


class MatmulStep:
    """A fixed amount of single-threaded CPU work, the stand-in for a too-slow model step."""

    def __init__(self, repeats: int, n: int = 256) -> None:
        gen = torch.Generator().manual_seed(1)
        self.a = torch.randn(n, n, generator=gen)
        self.b = torch.randn(n, n, generator=gen)
        self.repeats = repeats

    def __call__(self) -> None:
        for _ in range(self.repeats):
            torch.mm(self.a, self.b)

    @staticmethod
    def calibrate(target_s: float, n: int = 256) -> int:
        """How many n×n matmuls take about `target_s` on this rank, now."""
        probe = MatmulStep(10, n)
        probe()
        start = time.perf_counter()
        probe()
        per = (time.perf_counter() - start) / 10
        return max(1, int(round(target_s / max(per, 1e-6))))


def time_calls(fn: Callable[[], None], count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out
