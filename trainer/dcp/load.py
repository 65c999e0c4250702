"""Start a run from a DCP checkpoint (`load_dcp_model`): every tensor of the model matched before a byte is read, then
each rank reads only its share, by byte ranges, whatever world size saved it (docs/torchtitan.md).

Not here: the metadata (`ftsup.store.dcpdir`), the ranged reads (`boxread`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftsup.store import dcpdir
from ftsup.store.errors import CheckpointError, ModelFileError
from ftsup.trainer.checkpoint import codec, gcpause
from ftsup.trainer.dcp.boxread import BoxReader
from ftsup.trainer.hf.load import agree


@dataclass(frozen=True)
class DcpInit:
    origin: dict[str, Any]
    """Where the weights came from: `{"dir", "step", "prefix", "files": {file: bytes}, "tensors", "bytes"}`."""
    bytes_read: int
    """Bytes of tensor data this rank read from the files."""
    structure_bytes_read: int
    """Bytes of the data files' own records (each chunk's archive directory and pickle) read to find them."""


@dataclass(frozen=True)
class _Target:
    key: str  # the model's state dict key
    source: str  # the checkpoint's name
    tensor: torch.Tensor  # the model's (a DTensor under FSDP2)
    box: tuple[tuple[int, ...], tuple[int, ...]] | None  # a DTensor's local offset and shape; None: not a DTensor


def load_dcp_model(
    model: torch.nn.Module,
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str | None = None,
    group: Any = None,
) -> DcpInit:
    """Load the model's tensors from the DCP checkpoint in `directory` (itself, its `step-N` folder of `step`, or its
    newest) into `model`: a collective over `group` (default the world) when torch.distributed is initialised.
    `prefix`: what the checkpoint's names put before the model's (default: found, `""` or `model.` and the like).
    Raises ModelFileError, on every rank, before anything is loaded."""
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    with gcpause.paused():  # a full collection on one rank stalls every rank at the next collective
        return _load(module, Path(directory), step, prefix, group)


def _load(module: torch.nn.Module, root: Path, step: int | None, prefix: str | None, group: Any) -> DcpInit:
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    state = module.state_dict()
    device = next((_local(t).device for t in state.values()), torch.device("cpu"))
    errors: list[BaseException] = []
    ckpt: dcpdir.DcpCheckpoint | None = None
    targets: list[_Target] = []
    try:
        ckpt = dcpdir.read(dcpdir.locate(root, step))
        prefix = prefix if prefix is not None else _prefix(ckpt, list(state))
        targets = _match(state, ckpt, prefix)
    except CheckpointError as e:
        errors.append(e)
    agree(errors, world, group, device, "reading the checkpoint's metadata")
    if ckpt is None or prefix is None:  # `agree` raised
        raise ModelFileError(f"{root}: not read")
    values: list[tuple[_Target, torch.Tensor]] = []
    with BoxReader(ckpt) as reader:
        for t in targets:  # every rank takes part in every collective, whatever failed on it
            values.append((t, _share(t, ckpt, reader, world, rank, group, device, errors)))
        agree(errors, world, group, device, "reading the checkpoint's tensors")
        read, structure = reader.bytes_read, reader.structure_bytes_read
    with torch.no_grad():
        for t, value in values:
            _local(t.tensor).copy_(value)
    origin = {
        "dir": str(ckpt.path.resolve()),
        "step": _step_of(ckpt.path),
        "prefix": prefix,
        "files": dict(ckpt.files),
        "tensors": len(targets),
        "bytes": sum(ckpt.tensors[t.source].nbytes for t in targets),
    }
    return DcpInit(origin, read, structure)


def _prefix(ckpt: dcpdir.DcpCheckpoint, keys: list[str]) -> str:
    """The one string that, put before each of the model's keys, names a tensor of the checkpoint for all of them."""
    if not keys:
        return ""
    first = keys[0]
    found = [name[: -len(first)] for name in ckpt.tensors if name.endswith(first)]
    fits = [p for p in found if all(p + k in ckpt.tensors for k in keys)]
    if len(fits) == 1:
        return fits[0]
    if "" in fits:
        return ""
    if not fits:
        near = sorted(found)[:3] or "none"
        raise ModelFileError(
            f"{ckpt.path}: no prefix names every tensor of the model (the model's {first!r:.200} is there under "
            f"{near}); pass prefix="
        )
    raise ModelFileError(f"{ckpt.path}: the model's tensors are there under {sorted(fits)[:5]}; pass prefix=")


def _match(state: dict[str, torch.Tensor], ckpt: dcpdir.DcpCheckpoint, prefix: str) -> list[_Target]:
    """Every tensor of the model matched to the checkpoint's by name, shape and dtype; tied weights once."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    targets = []
    for key, t in state.items():
        tie = (_local(t).data_ptr(), tuple(t.shape))
        if tie in seen and _local(t).numel():
            continue
        seen.add(tie)
        source = prefix + key
        where = f"{ckpt.path / dcpdir.METADATA_NAME}: tensor {source!r:.200}"
        found = ckpt.tensors.get(source)
        if found is None:
            what = "a value saved as bytes, not a tensor" if source in ckpt.blobs else "not there"
            raise ModelFileError(f"{where}: the model has {key!r:.200}, and the checkpoint's is {what}")
        if found.size != tuple(t.shape):
            raise ModelFileError(f"{where} has shape {list(found.size)}; the model's {key!r} is {list(t.shape)}")
        if found.dtype != codec.dtype_name(t.dtype):
            raise ModelFileError(f"{where} is {found.dtype}; the model's {key!r} is {codec.dtype_name(t.dtype)}")
        targets.append(_Target(key, source, t, _box(t) if codec.is_dtensor(t) else None))
    return targets


def _share(
    t: _Target,
    ckpt: dcpdir.DcpCheckpoint,
    reader: BoxReader,
    world: int,
    rank: int,
    group: Any,
    device: torch.device,
    errors: list[BaseException],
) -> torch.Tensor:
    """This rank's value of `t`: its DTensor shard's box, or the whole tensor (alone; else its rows read here and
    the rest gathered from the other ranks). A read that fails is added to `errors` (zeros stand in) and the
    collectives still take place."""
    size = ckpt.tensors[t.source].size
    dtype = t.tensor.dtype

    def attempt(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        if not errors:
            try:
                return reader.read(t.source, offsets, sizes)
            except (CheckpointError, OSError) as e:
                errors.append(e)
        return torch.zeros(sizes, dtype=dtype)

    if t.box is not None:
        return attempt(*t.box)
    if world == 1:
        return attempt((0,) * len(size), size)
    n = size[0] if size else 0
    if n < world:  # 0-dimensional, or fewer rows than ranks: rank 0 reads it all
        whole = attempt((0,) * len(size), size) if rank == 0 else torch.zeros(size, dtype=dtype)
        buf = whole.reshape(-1).view(torch.uint8).to(device)
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return buf.cpu().view(dtype).reshape(size)
    c = -(-n // world)
    lo, hi = min(rank * c, n), min((rank + 1) * c, n)
    mine = torch.zeros((c, *size[1:]), dtype=dtype)
    if hi > lo:
        mine[: hi - lo].copy_(attempt((lo,) + (0,) * (len(size) - 1), (hi - lo, *size[1:])))
    flat = mine.reshape(-1).view(torch.uint8).to(device)
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat, group=group)
    return torch.cat(parts).cpu().view(dtype).reshape((c * world, *size[1:]))[:n]


def _step_of(path: Path) -> int | None:
    name = path.name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def _box(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local offset in the whole tensor and its local shape."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(offset), tuple(local)


def _local(t: Any) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local tensor, or `t` itself."""
    return t.to_local() if codec.is_dtensor(t) else t
