"""Save planning and staging: the part of `CheckpointEngine.save` that runs in the caller's thread.

The plan is cached per state structure; this rank's chunks are copied into a buffer laid out as the shard file
(trainer/checkpoint/DESIGN.md, "What is DCP's and what is ours").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from ftsup.store import blocksum, layout
from ftsup.store.errors import CheckpointError
from ftsup.trainer.checkpoint import codec, saveplan
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.devcopy import Copies, SideStreams
from ftsup.trainer.checkpoint.shardio import ShardLayout, aligned_buffer, as_memoryview, build_layout


@dataclass
class StagingPlan:
    signature: tuple[Any, ...]
    layout: ShardLayout
    sources: list[tuple[str, tuple[int, ...]]]  # (fqn, chunk offsets) per layout slot
    meta_head: bytes | None
    """Rank 0 only: the DCP metadata and every rank's slots, encoded once for every save of this plan, as a JSON
    object without its closing brace (`metadata_bytes` adds a save's skeleton). Kept encoded, not as objects: at
    thousands of ranks it lists millions of chunks, which as Python objects take gigabytes and seconds to encode."""
    tensor_bytes: int
    views: dict[int, list[torch.Tensor | None]] = field(default_factory=dict, repr=False, compare=False)
    """Each buffer's slots as tensors of their dtype and shape (None for an empty slot), by the buffer's address:
    made once per buffer, so that a save's copies are only the copies (the engine forgets a buffer it drops)."""


def metadata_bytes(plan: StagingPlan, skeleton: Any) -> bytes:
    """A save's `dcp_metadata.json`: the plan's encoded metadata and the save's skeleton (the same bytes as
    encoding the whole object, compact, with the skeleton last)."""
    assert plan.meta_head is not None
    return plan.meta_head + b',"skeleton":' + json.dumps(skeleton, separators=(",", ":")).encode() + b"}"


def encode_head(meta_json: dict[str, Any]) -> bytes:
    """`meta_json` as compact JSON without its closing brace (see `StagingPlan.meta_head`)."""
    if not meta_json or "skeleton" in meta_json:
        raise CheckpointError("the DCP metadata of a plan holds tensors and storage, and no skeleton")
    raw = json.dumps(meta_json, separators=(",", ":")).encode()
    return raw[:-1]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if codec.is_dtensor(t) else t  # type: ignore[attr-defined]


def _local_chunks(t: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if codec.is_dtensor(t):
        return [(tuple(c.offsets), tuple(c.sizes)) for c in t.__create_chunk_list__()]  # type: ignore[attr-defined]
    return [((0,) * t.dim(), tuple(t.shape))]


@torch.no_grad()  # DTensor.to_local() then skips autograd: 0.2 us a tensor instead of 5
def signature(flat: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """What the cached save plan depends on: names, global shapes, dtypes and how each tensor is
    split. A DTensor's local chunks follow from its mesh, placements and global shape (for this
    rank), which are much cheaper to compare than the chunk lists are to compute on every save."""
    return tuple(
        (k, True, tuple(t.shape), t.dtype, t.device_mesh, tuple(t.placements), tuple(t.to_local().shape))  # type: ignore[attr-defined]
        if codec.is_dtensor(t)
        else (k, False, tuple(t.shape), t.dtype)
        for k, t in flat.items()
    )


def make_plan(flat: dict[str, torch.Tensor], sig: tuple[Any, ...], comm: LocalComm | GroupComm) -> StagingPlan:
    """Plan this save (a collective on `comm`: every rank calls it): in compact form (`saveplan`: each rank's
    items gathered, the coordinator's dedup, checks and layouts, each rank's chunks scattered), or, when any
    rank's state holds what that form cannot say, with DCP's planner: each rank's local plan (`plan_local`), the
    coordinator's global one (`plan_global`), each rank's layout (`plan_finish`)."""
    gathered_items = comm.gather(saveplan.local_items(flat))
    compact: list[Any] | None = None
    head: bytes | None = None
    if comm.rank == 0:
        assert gathered_items is not None
        if all(items is not None for items in gathered_items):
            chunks, head = compact_global(gathered_items)
            compact = [(c,) for c in chunks]  # a rank's chunks, boxed: None says "DCP's planner instead"
        else:
            compact = [None] * len(gathered_items)
    mine_compact = comm.scatter(compact)
    if mine_compact is not None:
        return compact_finish(sig, mine_compact[0], head)
    planner, local = plan_local(flat, comm.rank == 0)
    gathered = comm.gather(local)
    per_rank: list[SavePlan] | None = None
    meta_head: bytes | None = None
    if comm.rank == 0:
        assert gathered is not None
        per_rank, meta_head = plan_global(planner, gathered)
    return plan_finish(planner, sig, comm.scatter(per_rank), meta_head)


def compact_global(gathered: list[list[saveplan.Item]]) -> tuple[list[list[saveplan.Chunk]], bytes]:
    """The coordinator's part of the compact plan: every rank's chunks and the checkpoint's DCP metadata (encoded,
    see `StagingPlan.meta_head`), the same as `plan_global`'s for the same state."""
    per_rank, tensors = saveplan.plan_global(gathered)
    return per_rank, encode_head({"tensors": tensors, "storage": _storage(per_rank)})


def compact_finish(sig: tuple[Any, ...], mine: list[saveplan.Chunk], meta_head: bytes | None) -> StagingPlan:
    """One rank's part of the compact plan after the scatter: its shard file's layout."""
    shard = build_layout(mine)
    sources = [(s.fqn, s.offsets) for s in shard.slots]
    return StagingPlan(sig, shard, sources, meta_head, sum(s.nbytes for s in shard.slots))


def plan_local(flat: dict[str, Any], coordinator: bool) -> tuple[DefaultSavePlanner, SavePlan]:
    """One rank's part of `make_plan` before the gather: its planner and local plan."""
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(flat, None, coordinator)
    return planner, planner.create_local_plan()


def plan_global(planner: DefaultSavePlanner, gathered: list[SavePlan]) -> tuple[list[SavePlan], bytes]:
    """The coordinator's part of `make_plan`: every rank's final plan and the checkpoint's DCP metadata (encoded,
    see `StagingPlan.meta_head`)."""
    per_rank, metadata = planner.create_global_plan(gathered)
    return per_rank, encode_head(_metadata_to_json(metadata, [_plan_chunks(p) for p in per_rank]))


def plan_finish(
    planner: DefaultSavePlanner, sig: tuple[Any, ...], mine: SavePlan, meta_head: bytes | None
) -> StagingPlan:
    """One rank's part of `make_plan` after the scatter: its shard file's layout."""
    shard = build_layout(_plan_chunks(planner.finish_plan(mine)))
    sources = [(s.fqn, s.offsets) for s in shard.slots]
    nbytes = sum(s.nbytes for s in shard.slots)
    return StagingPlan(sig, shard, sources, meta_head, nbytes)


def on_cuda(flat: dict[str, torch.Tensor]) -> bool:
    """True when any of the state's (local) tensors is in CUDA memory."""
    return any(local_tensor(t).is_cuda for t in flat.values())


def host_buffer(plan: StagingPlan, buf: torch.Tensor | None, allocate: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """`buf` when it is of `plan`'s size; otherwise a new one from `allocate`, holding the file header."""
    if buf is not None and buf.numel() == plan.layout.total_size:
        return buf
    buf = allocate(plan.layout.total_size)
    buf[: plan.layout.data_start].copy_(torch.frombuffer(bytearray(plan.layout.header), dtype=torch.uint8))
    return buf


def _views(plan: StagingPlan, buf: torch.Tensor) -> list[torch.Tensor | None]:
    views = plan.views.get(buf.data_ptr())
    if views is None:
        views = [
            buf[s.byte_offset : s.byte_offset + s.nbytes].view(s.dtype).view(s.sizes) if s.nbytes else None
            for s in plan.layout.slots
        ]
        plan.views[buf.data_ptr()] = views
    return views


@torch.no_grad()
def stage(
    plan: StagingPlan, flat: dict[str, torch.Tensor], buf: torch.Tensor | None, side: SideStreams | None = None
) -> tuple[torch.Tensor, Copies | None, list[int] | None]:
    """Copy this rank's chunks into `buf` (a new one from `host_buffer` when None or of another size): (the buffer,
    the CUDA copies in flight, block CRCs).

    CUDA chunks (`side` given) are launched on the side streams and not waited for (`devcopy`): the buffer holds
    them once the copies have landed. On CPU with hardware CRC-32C the block checksums are computed by the copy
    itself (one pass over the bytes, see blocksum.StreamingBlocks); otherwise they are None and the writer thread
    computes them from the buffer.
    """
    buf = host_buffer(plan, buf, aligned_buffer if side is None else functools.partial(aligned_buffer, pin=True))
    sums = None
    if side is None and blocksum.fused_copy_available():
        sums = blocksum.StreamingBlocks(plan.layout.total_size)
        mv = as_memoryview(buf)
        sums.update(mv[: plan.layout.data_start], 0)
    device: list[tuple[torch.Tensor, torch.Tensor]] = []
    for slot, (fqn, offsets), dst in zip(plan.layout.slots, plan.sources, _views(plan, buf), strict=True):
        src = local_tensor(flat[fqn]).detach()
        if tuple(src.shape) != slot.sizes:
            # The signature matched, so this is a chunk narrower than the local tensor.
            src = _narrow(src, offsets, flat[fqn], slot.sizes)
        if dst is None:
            continue
        if side is not None and src.is_cuda:
            device.append((dst, src))
            continue
        if sums is None:
            dst.copy_(src)
            continue
        start, end = slot.byte_offset, slot.byte_offset + slot.nbytes
        raw = _raw_bytes(src, slot.dtype)
        if raw is not None:
            sums.copy(mv[start:end], raw, start)
        else:  # a layout only torch copies: copy, then checksum the copy
            dst.copy_(src)
            sums.update(mv[start:end], start)
    copies = side.launch(device) if side is not None and device else None
    return buf, copies, None if sums is None else sums.finish()


def _plan_chunks(plan: SavePlan) -> list[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]]:
    out = []
    for item in plan.items:
        td = item.tensor_data
        if td is None:
            raise CheckpointError(f"unexpected non-tensor write item {item.index.fqn}")
        out.append((item.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.properties.dtype))
    return out


def _raw_bytes(src: torch.Tensor, dtype: torch.dtype) -> memoryview | None:
    """The bytes of a dense, contiguous CPU tensor of `dtype`, without a copy; None otherwise
    (the caller then copies with torch, which handles every layout)."""
    if (
        src.device.type != "cpu"
        or src.dtype != dtype
        or not src.is_contiguous()
        or src.is_conj()
        or src.is_neg()
        or src.layout != torch.strided
    ):
        return None
    return as_memoryview(src.reshape(-1).view(torch.uint8))


def _narrow(src: torch.Tensor, offsets: tuple[int, ...], whole: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    base = _local_chunks(whole)[0][0]
    for dim, (o, b, n) in enumerate(zip(offsets, base, sizes, strict=True)):
        src = src.narrow(dim, o - b, n)
    return src


def _metadata_to_json(metadata: Metadata, per_rank_chunks: list[list[Any]]) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"unexpected non-tensor entry {fqn} in the save plan")
        tensors[fqn] = {
            "dtype": codec.dtype_name(md.properties.dtype),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    return {"tensors": tensors, "storage": _storage(per_rank_chunks)}


def _storage(per_rank_chunks: list[list[Any]]) -> list[dict[str, Any]]:
    storage = []
    for rank, chunks in enumerate(per_rank_chunks):
        for slot in build_layout(chunks).slots:
            storage.append(
                {
                    "fqn": slot.fqn,
                    "offsets": list(slot.offsets),
                    "sizes": list(slot.sizes),
                    "file": layout.shard_name(rank),
                    "crc_file": layout.crc_name(rank),
                    "byte_offset": slot.byte_offset,
                    "nbytes": slot.nbytes,
                }
            )
    return storage
