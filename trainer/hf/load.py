"""Start a run from a Hugging Face Hub-layout model (`load_hf_model`): every tensor matched before a byte is read,
then each rank reads only its share, by byte ranges (docs/hf.md; trainer/checkpoint/DESIGN.md, Import).

Not here: the headers (`ftsup.store.hublayout`), the ranged reads (`hubread`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftsup.store import hublayout
from ftsup.store.errors import CheckpointError, ModelFileError
from ftsup.trainer.checkpoint import codec, gcpause
from ftsup.trainer.checkpoint.shardio import aligned_buffer, round_up
from ftsup.trainer.hf.hubread import HubReader

_ALIGN = 64  # a staging slot's alignment: any dtype's elements, and a cache line


@dataclass(frozen=True)
class HfInit:
    origin: dict[str, Any]
    """Where the weights came from: `{"dir", "files": {file: bytes}, "tensors", "bytes"}`."""
    bytes_read: int
    """Bytes of tensor data this rank read from the files."""


@dataclass(frozen=True)
class _Target:
    """One tensor of the model and how this rank reads it, worked out once per load (`_match`)."""

    key: str  # the model's state dict key
    source: str  # the files' name
    tensor: torch.Tensor  # the model's tensor (a DTensor under FSDP2)
    dtype: torch.dtype  # the file's
    shape: tuple[int, ...]  # the file's, in torch's terms
    box: tuple[tuple[int, ...], tuple[int, ...]] | None  # a DTensor's local shape and offset; None: not a DTensor
    mem: torch.Tensor | None  # this rank's part's memory where it is read straight into it (`_in_place`)


def load_hf_model(
    model: torch.nn.Module,
    directory: str | os.PathLike[str],
    *,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    convert: bool = False,
    group: Any = None,
) -> HfInit:
    """Load the Hub-layout model in `directory` into `model` (a collective over `group`, default the world,
    when torch.distributed is initialised). Raises ModelFileError, on every rank, before anything is loaded."""
    root = Path(directory)
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    with gcpause.paused():  # a full collection on one rank stalls every rank at the next collective
        return _load(module, root, rename, convert, group)


def _load(
    module: torch.nn.Module,
    root: Path,
    rename: Mapping[str, str] | Callable[[str], str] | None,
    convert: bool,
    group: Any,
) -> HfInit:
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    state = module.state_dict()
    device = next((t.device for t in state.values()), torch.device("cpu"))
    errors: list[BaseException] = []
    try:
        hub = hublayout.read(root)
    except CheckpointError as e:
        errors.append(e)
    agree(errors, world, group, device, "reading the model's headers")
    with HubReader(hub) as reader:
        try:
            targets = _match(state, hub, reader, rename, convert, world)
        except CheckpointError as e:
            errors.append(e)
            targets = []
        agree(errors, world, group, device, "matching the model's tensors")
        # Every rank takes part in every collective, whatever failed on it: the ranks agree only afterwards.
        take = _staging([_direct_bytes(t, reader, world) for t in targets])
        parts = {id(t): p for t in targets if (p := _in_place_part(t)) is not None}
        if parts and not errors:  # what is read straight into place is read all at once, without collectives
            try:
                reader.read_rows_into(list(parts.values()))
            except (CheckpointError, OSError) as e:
                errors.append(e)
        rest = [t for t in targets if id(t) not in parts]
        staged = [(t, _read_share(t, reader, world, rank, group, device, errors, take)) for t in rest]
        agree(errors, world, group, device, "reading the model's tensors")
    with torch.no_grad():
        for t, value in staged:
            if value is not None:  # None: read in place
                _local(t.tensor).copy_(value)
    files = {f: h.file_size for f, h in hub.headers.items()}
    origin = {
        "dir": str(root.resolve()),
        "files": files,
        "tensors": len(targets),
        "bytes": sum(hub.tensors[t.source].nbytes for t in targets),
    }
    return HfInit(origin, reader.bytes_read)


def _match(
    state: Mapping[str, torch.Tensor],
    hub: hublayout.HubModel,
    reader: HubReader,
    rename: Mapping[str, str] | Callable[[str], str] | None,
    convert: bool,
    world: int,
) -> list[_Target]:
    """Every tensor of the model's `state` matched to one of the files', checked, with how this rank reads it;
    the errors name file and tensor."""

    def source_of(key: str) -> str:
        if rename is None:
            return key
        return rename(key) if callable(rename) else rename.get(key, key)

    by_storage: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, t in state.items():
        by_storage.setdefault((_local(t).data_ptr(), tuple(t.shape)), []).append(key)
    targets: list[_Target] = []
    used: set[str] = set()
    for keys in by_storage.values():  # tied weights: one name of theirs in the files is enough
        present = [k for k in keys if source_of(k) in hub.weight_map]
        if not present:
            key = keys[0]
            raise ModelFileError(
                f"{hub.root}: the model has tensor {key!r} (as {source_of(key)!r} in the files), "
                "which no file of the model holds"
            )
        key, source = present[0], source_of(present[0])
        t = state[key]
        dtype, shape = reader.spec(source)
        where = f"{hub.root / hub.weight_map[source]}: tensor {source!r}"
        if shape != tuple(t.shape):
            raise ModelFileError(f"{where} has shape {list(shape)}; the model's {key!r} is {list(t.shape)}")
        if dtype != t.dtype and not (convert and dtype.is_floating_point and t.dtype.is_floating_point):
            raise ModelFileError(
                f"{where} is {codec.dtype_name(dtype)}; the model's {key!r} is "
                f"{codec.dtype_name(t.dtype)} (convert=True converts floating dtypes)"
            )
        box = _box(t) if codec.is_dtensor(t) else None
        targets.append(_Target(key, source, t, dtype, shape, box, _in_place(t, dtype, shape, box, world)))
        used.update(source_of(k) for k in present)
    extra = [name for name in hub.weight_map if name not in used]
    if extra:
        raise ModelFileError(
            f"{hub.root / hub.weight_map[extra[0]]}: holds tensor {extra[0]!r}, which the model does "
            f"not have ({len(extra)} such tensors)"
        )
    return targets


def _in_place(
    tensor: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    box: tuple[tuple[int, ...], tuple[int, ...]] | None,
    world: int,
) -> torch.Tensor | None:
    """The bytes of this rank's part of `tensor` (a contiguous uint8 view of its memory) where they can be read
    straight into it: on the CPU, the file's dtype, whole rows of dim 0 (FSDP2), or the whole tensor alone; else
    None."""
    local = _local(tensor)
    if not shape or local.device.type != "cpu" or local.dtype != dtype or not local.is_contiguous():
        return None
    if box is not None:
        if tuple(box[0][1:]) != tuple(shape[1:]):
            return None
    elif world != 1:
        return None
    return local.detach().reshape(-1).view(torch.uint8)


def _in_place_part(t: _Target) -> tuple[str, int, int, torch.Tensor] | None:
    """(source, first row, end row, memory) of this rank's part of `t` where it is read straight into place."""
    if t.mem is None:
        return None
    if t.box is not None:
        local, offset = t.box
        return (t.source, offset[0], offset[0] + local[0], t.mem) if local else None
    return t.source, 0, t.shape[0], t.mem


def _direct_bytes(t: _Target, reader: HubReader, world: int) -> int:
    """The bytes of `t` this rank reads into its staging buffer: its DTensor shard's rows, or, alone, all of it
    (0-dimensional tensors and the DDP path's rows, which are gathered, are read into buffers of their own; what
    is read in place needs none)."""
    shape = t.shape
    if not shape or t.mem is not None:
        return 0
    row = reader.entry(t.source).nbytes // shape[0] if shape[0] else 0
    if t.box is not None:
        local, _ = t.box
        return local[0] * row if local else 0
    return shape[0] * row if world == 1 else 0


def _staging(sizes: list[int]) -> Callable[[int], torch.Tensor]:
    """Slots of one page-aligned buffer, populated up front, handed out in the order of `sizes` (each aligned for
    any dtype)."""
    slot = [round_up(n, _ALIGN) for n in sizes]
    buf = aligned_buffer(sum(slot)) if sum(slot) else torch.empty(0, dtype=torch.uint8)
    pos = [0]

    def take(n: int) -> torch.Tensor:
        view = buf[pos[0] : pos[0] + n]
        pos[0] += round_up(n, _ALIGN)
        return view

    return take


def _box(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local shape and its offset in the whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(local), tuple(offset)


def _read_share(
    t: _Target,
    reader: HubReader,
    world: int,
    rank: int,
    group: Any,
    device: torch.device,
    errors: list[BaseException],
    take: Callable[[int], torch.Tensor],
) -> torch.Tensor | None:
    """This rank's value of `t`: its DTensor shard's rows, or the whole tensor (its rows read here, the
    rest gathered from the other ranks); None where it was read in place. A read that fails is added to
    `errors` (then zeros stand in) and the collectives still take place."""
    dtype, shape = t.dtype, t.shape

    def attempt(read: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
        if errors:
            return fallback()
        try:
            return read()
        except (CheckpointError, OSError) as e:
            errors.append(e)
            return fallback()

    mem = t.mem
    if t.box is not None:
        local, offset = t.box
        if len(local) == 0:
            return attempt(lambda: reader.read(t.source), lambda: torch.zeros((), dtype=dtype))
        if mem is not None:
            attempt(lambda: reader.read_rows(t.source, offset[0], offset[0] + local[0], mem), lambda: None)
            return None
        out = take(_direct_bytes(t, reader, world))

        def rows() -> torch.Tensor:
            part = reader.read_rows(t.source, offset[0], offset[0] + local[0], out)
            for dim in range(1, len(local)):
                part = part.narrow(dim, offset[dim], local[dim])
            return part

        return attempt(rows, lambda: torch.zeros(tuple(local), dtype=dtype))
    if world == 1:
        if mem is not None:
            attempt(lambda: reader.read(t.source, mem), lambda: None)
            return None
        whole = take(_direct_bytes(t, reader, world)) if shape else None
        return attempt(lambda: reader.read(t.source, whole), lambda: torch.zeros(shape, dtype=dtype))
    nbytes = reader.entry(t.source).nbytes
    n = shape[0] if shape else 0
    if n < world:  # 0-dimensional, or fewer rows than ranks: rank 0 reads it all
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        if rank == 0:
            buf = attempt(lambda: reader.read(t.source).reshape(-1).view(torch.uint8), lambda: buf)
        buf = buf.to(device)
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return buf.cpu().view(dtype).reshape(shape)
    c, row = -(-n // world), nbytes // n
    lo, hi = min(rank * c, n), min((rank + 1) * c, n)
    mine = torch.zeros((c, row), dtype=torch.uint8)
    if hi > lo:
        got = attempt(
            lambda: reader.read_rows(t.source, lo, hi).reshape(hi - lo, -1).view(torch.uint8), lambda: mine[: hi - lo]
        )
        mine[: hi - lo].copy_(got)
    mine = mine.to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts)[:n].cpu().reshape(-1).view(dtype).reshape(shape)


def agree(errors: list[BaseException], world: int, group: Any, device: torch.device, doing: str) -> None:
    """Raise on every rank when any rank failed (its own first error where it has one)."""
    failed = bool(errors)
    if world > 1:
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = bool(flag.item())
    if errors:
        raise errors[0]
    if failed:
        raise ModelFileError(f"another rank failed {doing}; nothing was loaded")


def _local(t: Any) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local tensor (a view of its shard), or `t` itself."""
    return t.to_local() if codec.is_dtensor(t) else t
