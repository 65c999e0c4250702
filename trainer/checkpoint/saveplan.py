"""The first save's plan in compact form: what DCP's `DefaultSavePlanner` decides, from plain tuples; a state the
tuples cannot say falls back to DCP's planner (trainer/checkpoint/DESIGN.md, "The plan at thousands of ranks").
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_right, insort
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from ftsup.trainer.checkpoint import codec

Item = tuple[str, bool, tuple[int, ...], tuple[int, ...], torch.dtype, tuple[int, ...]]
"""(fqn, a shard (not a whole tensor), chunk offsets, chunk sizes, dtype, the tensor's global size)."""
Chunk = tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]
"""What a rank writes of a tensor: (fqn, offsets, sizes, dtype), as `staging._plan_chunks` lists it."""


def local_items(flat: dict[str, Any]) -> list[Item] | None:
    """This rank's local plan as `create_default_local_save_plan` makes it, or None when the state holds anything
    the compact form cannot say."""
    out: list[Item] = []
    for fqn, obj in flat.items():
        if codec.is_dtensor(obj):
            if obj.device_mesh.get_coordinate() is None:
                continue  # not in this DTensor's mesh: nothing to write (as DCP's)
        if hasattr(obj, "__create_write_items__"):
            for w in obj.__create_write_items__(fqn, obj):
                td = w.tensor_data
                if w.type not in (WriteItemType.SHARD, WriteItemType.TENSOR) or td is None or td.chunk is None:
                    return None
                shard, chunk = w.type == WriteItemType.SHARD, td.chunk
                out.append((fqn, shard, tuple(chunk.offsets), tuple(chunk.sizes), td.properties.dtype, tuple(td.size)))
        elif type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            shape = tuple(obj.shape)
            out.append((fqn, False, (0,) * len(shape), shape, obj.dtype, shape))
        else:
            return None
    return out


def plan_global(gathered: list[list[Item]]) -> tuple[list[list[Chunk]], dict[str, Any]]:
    """The coordinator: every rank's chunks to write and the checkpoint's tensors ({fqn: {"dtype", "size",
    "chunks"}}, as `staging._metadata_to_json` writes them), as DCP's global save plan decides them."""
    kept = _dedup(gathered)
    tensors: dict[str, dict[str, Any]] = {}
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    per_rank: list[list[Chunk]] = []
    for items in kept:
        mine: list[Chunk] = []
        for fqn, shard, offsets, sizes, dtype, size in items:
            if not shard and fqn in tensors:
                raise AssertionError("item.index.fqn not in md")  # DCP's words
            if fqn not in tensors:
                tensors[fqn] = {"dtype": codec.dtype_name(dtype), "size": list(size), "chunks": []}
                boxes[fqn] = []
            tensors[fqn]["chunks"].append({"offsets": list(offsets), "sizes": list(sizes)})
            boxes[fqn].append((offsets, sizes))
            mine.append((fqn, offsets, sizes, dtype))
        per_rank.append(mine)
    errors: list[str] = []
    for fqn, t in tensors.items():
        if not _valid(tuple(t["size"]), boxes[fqn], len(kept) > 1):
            errors += _dcp_errors(fqn, t, boxes[fqn], dtype_of=_dtype(gathered, fqn), ranks=len(kept))
    if errors:
        summary = "; ".join(errors)
        if len(summary) > 500:
            summary = summary[:500] + "... (truncated)"
        raise ValueError(f"Failed to validate global plan: {summary}")
    return per_rank, tensors


def _dedup(gathered: list[list[Item]]) -> list[list[Item]]:
    """DCP's `dedup_save_plans` (not to the lowest rank) over tuples: the same choices in the same order."""
    if len({(i[0], i[2]) for items in gathered for i in items}) == sum(map(len, gathered)):
        return gathered  # nothing held twice (FSDP's shards): nothing to choose
    holders: dict[tuple[str, tuple[int, ...]], set[int]] = {}
    nbytes: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, items in enumerate(gathered):
        for fqn, _, offsets, sizes, dtype, _ in items:
            key = (fqn, offsets)
            holders.setdefault(key, set()).add(rank)
            nbytes[key] = math.prod(sizes) * dtype.itemsize
    planned = [0] * len(gathered)
    dropped: list[set[tuple[str, tuple[int, ...]]]] = [set() for _ in gathered]
    for key, ranks in holders.items():
        chosen = min(ranks, key=lambda r: planned[r])
        planned[chosen] += nbytes[key] or 1
        for r in ranks - {chosen}:
            dropped[r].add(key)
    return [
        [i for i in items if (i[0], i[2]) not in gone] if gone else items
        for items, gone in zip(gathered, dropped, strict=True)
    ]


def _valid(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], several: bool) -> bool:
    """`_validate_global_plan`'s checks of one tensor, true when it has nothing to say."""
    if not size:
        return True
    volume = 0
    for offsets, sizes in chunks:
        for o, n, s in zip(offsets, sizes, size, strict=False):
            if o < 0 or n < 0 or o + n > s:
                return False
        volume += math.prod(sizes)
    if len(chunks) > 1:
        # Swept along the dim the chunks are cut along most (DCP's sweeps its longest; either finds an overlap if
        # there is one), so that a tensor cut along a shorter dim is not compared pair by pair.
        sweep = max(range(len(size)), default=0, key=lambda d: len({c[0][d] for c in chunks}))
        order = sorted(range(len(chunks)), key=lambda i: (chunks[i][0][sweep], *chunks[i][0]))
        active: list[tuple[int, int]] = []
        for i in order:
            offsets, sizes = chunks[i]
            start = offsets[sweep]
            cutoff = bisect_right(active, (start, sys.maxsize))
            if cutoff:
                del active[:cutoff]
            for _, j in active:
                if _overlap(chunks[i], chunks[j]):
                    return False
            insort(active, (start + sizes[sweep], i))
    return not (several and volume != math.prod(size))


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True):
        if ao >= bo + bn or bo >= ao + an:
            return False
    return True


def _dtype(gathered: list[list[Item]], fqn: str) -> torch.dtype:
    return next(i[4] for items in gathered for i in items if i[0] == fqn)


def _dcp_errors(
    fqn: str,
    t: dict[str, Any],
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]],
    *,
    dtype_of: torch.dtype,
    ranks: int,
) -> list[str]:
    """DCP's own messages for a tensor that failed `_valid`."""
    from torch.distributed.checkpoint.default_planner import _validate_global_plan
    from torch.distributed.checkpoint.metadata import TensorProperties

    md = TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype_of),
        size=torch.Size(t["size"]),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
    return _validate_global_plan([None] * ranks, Metadata({fqn: md}))  # type: ignore[list-item]
