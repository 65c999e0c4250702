"""The synthetic job of `ftsup bench scale`: a Llama-style model's tensors (`model_tensors`) over N simulated ranks in
`pp` pipeline stages, each stage's tensors dim-0 sharded over its ranks as FSDP2's `Shard(0)` cuts them, each
rank's state as `SimShard`s, and what each rank reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ftsup.store import layout


@dataclass(frozen=True)
class Model:
    layers: int = 32
    hidden: int = 4096
    ffn: int = 11008
    vocab: int = 32000
    dtype: torch.dtype = torch.bfloat16
    optimizer: bool = False
    """With AdamW's two moments per parameter (three tensors a parameter instead of one)."""


def model_tensors(model: Model) -> list[tuple[int, str, tuple[int, ...]]]:
    """(layer, name, global shape) of every tensor; the embedding is layer -1, the head layer `layers`."""
    h, f = model.hidden, model.ffn
    per_layer: list[tuple[str, tuple[int, ...]]] = [
        ("attn.q", (h, h)),
        ("attn.k", (h, h)),
        ("attn.v", (h, h)),
        ("attn.o", (h, h)),
        ("mlp.gate", (f, h)),
        ("mlp.up", (f, h)),
        ("mlp.down", (h, f)),
        ("norm_attn", (h,)),
        ("norm_mlp", (h,)),
    ]
    params: list[tuple[int, str, tuple[int, ...]]] = [(-1, "embed", (model.vocab, h))]
    for i in range(model.layers):
        params += [(i, f"layers.{i}.{name}", shape) for name, shape in per_layer]
    params += [(model.layers, "norm", (h,)), (model.layers, "head", (model.vocab, h))]
    out = [(layer, f"model.{name}", shape) for layer, name, shape in params]
    if model.optimizer:
        for moment in ("exp_avg", "exp_avg_sq"):
            out += [(layer, f"optim.{name}.{moment}", shape) for layer, name, shape in params]
    return out


class SimShard:
    """One rank's dim-0 shard of a tensor that no process holds, as DCP's planners see a DTensor: what they ask of
    one (`__create_write_items__`, `__create_chunk_list__`, `size()`), so that N ranks' planning runs in one process,
    through DCP's own planner code, without N processes or a process group."""

    __slots__ = ("dtype", "offsets", "shape", "sizes")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, offsets: tuple[int, ...], sizes: tuple[int, ...]):
        self.shape, self.dtype, self.offsets, self.sizes = shape, dtype, offsets, sizes

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        offsets, sizes = torch.Size(self.offsets), torch.Size(self.sizes)
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=self.dtype), size=torch.Size(self.shape))
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))]


def dim0_shard(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, rows) of piece `index` of `parts` of a dim of `length`, as `torch.chunk` (FSDP2's Shard(0)) cuts it."""
    step = -(-length // parts)
    start = min(index * step, length)
    return start, min(step, length - start)


class Job:
    """N simulated ranks of `model` in `pp` pipeline stages (N must be a multiple of `pp`), each stage a contiguous
    run of layers (the first with the embedding, the last with the final norm and the head)."""

    def __init__(self, model: Model, world_size: int, pp: int):
        if world_size < 1 or pp < 1 or world_size % pp:
            raise ValueError(f"the world size ({world_size}) must be a positive multiple of the stages ({pp})")
        self.model, self.world_size, self.pp = model, world_size, min(pp, model.layers + 2)
        self.dp = world_size // self.pp
        tensors = model_tensors(model)
        per = -(-(model.layers + 2) // self.pp)  # the embedding and the head count as a layer each
        self.stage_tensors: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(self.pp)]
        for layer, name, shape in tensors:
            self.stage_tensors[min((layer + 1) // per, self.pp - 1)].append((name, shape))

    def rank_state(self, rank: int) -> dict[str, SimShard]:
        """Rank `rank`'s flat state: a SimShard per tensor of its stage."""
        stage, index = divmod(rank, self.dp)
        out = {}
        for name, shape in self.stage_tensors[stage]:
            start, rows = dim0_shard(shape[0], self.dp, index)
            out[name] = SimShard(shape, self.model.dtype, (start, *(0,) * (len(shape) - 1)), (rows, *shape[1:]))
        return out

    def chunks(self) -> int:
        return self.pp * self.dp * max(len(t) for t in self.stage_tensors)


def rank_report(rank: int, shard_bytes: int, rank_state_bytes: int = 96) -> dict[str, Any]:
    """What a rank's writer hands the commit after writing its files (`commit.Committer._write_rank_files`):
    names, sizes and checksums (synthetic values of the real format)."""
    blocks = max(1, -(-shard_bytes // layout.CHECKSUM_BLOCK_BYTES))
    algo = layout.CHECKSUM_ALGORITHM
    files = {
        layout.shard_name(rank): {"size": shard_bytes, "checksum": f"{algo}:{rank * 3 & 0xFFFFFFFF:08x}"},
        layout.crc_name(rank): {"size": 4 * blocks, "checksum": f"{algo}:{rank * 3 + 1 & 0xFFFFFFFF:08x}"},
        layout.rank_state_name(rank): {"size": rank_state_bytes, "checksum": f"{algo}:{rank * 3 + 2 & 0xFFFFFFFF:08x}"},
    }
    return {"ok": True, "files": files, "tensor_bytes": shard_bytes}


def write_rank_files(directory: str, report: dict[str, Any]) -> None:
    """The files a rank's report names, empty and sparse at their recorded sizes (only metadata is measured)."""
    for name, entry in report["files"].items():
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, entry["size"])
        finally:
            os.close(fd)
