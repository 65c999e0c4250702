"""Writing a model in the Hugging Face Hub's layout, one tensor in memory at a time.

`write_model(out, tensors, max_shard_bytes)` writes what huggingface_hub's `save_torch_state_dict`
writes for a state dict of those tensors in that order: `model.safetensors`, or past the shard size
`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json` (the split, the names and the
index are `ftsup.store.hublayout`'s; each file's header and the order of its bytes `stheader`'s, as
safetensors' writer lays them out). Each file's header is written first, from the tensors' dtypes
and shapes; then each tensor is read (`OutTensor.read`), converted to the dtype it is written in,
written and let go: whatever the shard size, one tensor is in memory (with the one it was converted
from). Files are created with O_EXCL | O_NOFOLLOW (never written through a link) and fsynced.

Not here: where the tensors come from, the output directory and its rename (`hf`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftsup.store import hublayout, stheader
from ftsup.store.errors import CheckpointError
from ftsup.trainer.checkpoint import codec
from ftsup.trainer.checkpoint.shardio import as_memoryview

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_WRITE_BLOCK = 64 << 20
FILE_METADATA = {"format": "pt"}  # what save_torch_state_dict (and save_pretrained) put in every file


@dataclass(frozen=True)
class OutTensor:
    """One tensor to write: its name in the model, the dtype and (torch) shape it is written in, and how
    to read it (whole, on the CPU, in its stored dtype; converted here when that is not `dtype`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    def header(self) -> tuple[str, list[int]]:
        """Its safetensors dtype and shape; CheckpointError naming it where safetensors has none."""
        entry = codec.safetensors_header(self.dtype, list(self.shape), self.name)
        if entry is None:
            dims = "" if self.shape else " (0-dimensional)"
            raise CheckpointError(
                f"tensor {self.name!r} has dtype {codec.dtype_name(self.dtype)}{dims}, which safetensors cannot "
                "store; convert it (or leave it out with --prefix) before exporting"
            )
        return entry


def check(tensors: Sequence[OutTensor]) -> None:
    """Refuse, before anything is written, what cannot be written: a dtype safetensors lacks, a name twice."""
    seen: set[str] = set()
    for t in tensors:
        t.header()
        if t.name in seen:
            raise CheckpointError(f"two tensors are named {t.name!r}")
        seen.add(t.name)


def write_model(
    out: Path, tensors: Sequence[OutTensor], max_shard_bytes: int, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Write `tensors` into the directory `out` (which this process created); returns the index
    (`{"metadata": {"total_size"}, "weight_map"}`, also for one file, where none is written).
    `progress(n)`: called with each tensor's bytes once they are written."""
    check(tensors)
    shards = hublayout.plan_shards([(t.name, t.nbytes) for t in tensors], max_shard_bytes)
    by_name = {t.name: t for t in tensors}
    weight_map: dict[str, str] = {}
    for fname, group in zip(hublayout.shard_names(len(shards)), shards, strict=True):
        _write_file(out / fname, [by_name[n] for n in group], progress)
        weight_map.update(dict.fromkeys(group, fname))
    total = sum(t.nbytes for t in tensors)
    if len(shards) > 1:
        write_new(out / hublayout.INDEX_NAME, hublayout.index_bytes(weight_map, total))
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def write_new(path: Path, data: bytes | memoryview) -> None:
    """Create `path` (never one that exists, never through a link), write `data`, fsync."""
    fd = os.open(path, _CREATE, 0o644)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, group: Sequence[OutTensor], progress: Callable[[int], None] | None) -> None:
    entries = [(t.name, *t.header(), t.nbytes) for t in group]
    order = stheader.write_order([(name, st_dtype) for name, st_dtype, _, _ in entries])
    head = stheader.encode([entries[i] for i in order], FILE_METADATA)
    fd = os.open(path, _CREATE, 0o644)
    try:
        _write_all(fd, memoryview(head))
        for i in order:
            t = group[i]
            data = t.read()
            if data.dtype != t.dtype:
                data = data.to(t.dtype)
            if tuple(data.shape) != t.shape:
                raise CheckpointError(f"tensor {t.name!r} was read with shape {list(data.shape)}, not {list(t.shape)}")
            if data.numel():
                _write_all(fd, as_memoryview(data.contiguous().reshape(-1).view(torch.uint8)))
            del data
            if progress is not None:
                progress(t.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, mv: memoryview) -> None:
    pos = 0
    while pos < len(mv):
        n = os.write(fd, mv[pos : pos + _WRITE_BLOCK])
        if n <= 0:
            raise OSError("short write")
        pos += n
