"""`ShardReader`: the DCP `StorageReader` under `CheckpointEngine.load`, every byte range verified before any copy
into the caller's tensors (trainer/checkpoint/DESIGN.md, Loading).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from ftsup.store import layout
from ftsup.store.errors import CheckpointCorruptError, CheckpointError, DurableTierError
from ftsup.trainer.checkpoint import codec, loadplan
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.shardio import VerifiedFile, read_files


@dataclass(frozen=True)
class ChunkLocation:
    file: str
    crc_file: str
    byte_offset: int
    sizes: tuple[int, ...]
    dtype: torch.dtype


class FileSource(Protocol):
    """Where a checkpoint's shard files are read from, when not from the local store (a durable tier's)."""

    threads: int
    piece: int

    def verified_file(self, rel: str, crc_rel: str) -> VerifiedFile: ...


class ShardReader(StorageReader):
    """A DCP StorageReader over our shard files: ranged reads, verified before any copy. `source`: the files come
    from there (a durable tier, `durableread`) instead of the directory `path`."""

    def __init__(
        self,
        path: Path | str,
        manifest: layout.Manifest,
        meta: Mapping[str, Any],
        comm: LocalComm | GroupComm,
        source: FileSource | None = None,
        *,
        names: Iterable[str] | None = None,
        pool: ThreadPoolExecutor | None = None,
        held: Collection[str] | None = None,
        kept: Mapping[str, list[tuple[int, torch.Tensor]]] | None = None,
    ) -> None:
        """`meta`: the checked DCP metadata (`dcpmeta.read`), or rank 0's packing of it (`loadplan.pack`), of
        which only the tensors `names` (all when None) are unpacked: this rank's, at thousands of ranks. `pool`:
        the reading threads of the local store's files (`shardio.reading_pool`; None: new ones for this load).
        `held`: the only files `path` holds (a copy of some of them, `peerload`); reading another is an error.
        `kept`: regions (start, bytes) of shard files this process holds, verified when they were received or read
        (`peerload.Restored.kept`): read from there, with no copy and no second check."""
        self.path = path
        self.pool = pool
        self.held = None if held is None else frozenset(held)
        self.kept = kept or {}
        self.manifest = manifest
        self.comm = comm
        self.source = source
        self.bytes_read = 0
        if "chunks" in meta:
            rows = loadplan.unpack(meta, meta["tensors"] if names is None else names)
        else:
            rows = loadplan.rows(meta)
        sd_meta: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self.locs: dict[MetadataIndex, ChunkLocation] = {}
        for fqn, saved in rows.items():
            t = meta["tensors"][fqn]
            dtype = codec.dtype_from_name(t["dtype"])
            chunks = []
            for offsets, sizes, file, crc_file, byte_offset in saved:
                for name in (file, crc_file):
                    layout.validate_relpath(name)
                    if name not in manifest.files:
                        raise CheckpointCorruptError(f"{path}: metadata names {name}, absent from the manifest")
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                self.locs[MetadataIndex(fqn, torch.Size(offsets))] = ChunkLocation(
                    file, crc_file, byte_offset, tuple(sizes), dtype
                )
            sd_meta[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(t["size"]), chunks=chunks
            )
        self.metadata = Metadata(state_dict_metadata=sd_meta, storage_data=self.locs)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        self._read_agreed(plan, planner, None)
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    def planned_ranges(self, flat: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges [start, end) of each file this rank's `load(flat, ...)` reads, planned as it plans them,
        and each shard's block checksums (no range: read whole); raises what DCP's planner raises where `flat` does
        not fit the checkpoint."""
        planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=False)
        planner.set_up_planner(flat, self.metadata, self.comm.rank == 0)
        out: dict[str, list[tuple[int, int]]] = {}
        for req in planner.create_local_plan().items:
            loc, start, end = self._range(req)
            out.setdefault(loc.file, []).append((start, end))
            out.setdefault(loc.crc_file, [])
        return out

    def _range(self, req: Any) -> tuple[ChunkLocation, int, int]:
        """Where read request `req`'s bytes lie: the smallest range of its saved chunk's file that covers them."""
        loc = self.locs.get(req.storage_index)
        if loc is None:
            raise CheckpointCorruptError(f"{self.path}: no stored chunk for {req.storage_index.fqn}")
        strides = _contiguous_strides(loc.sizes)
        first = sum(o * s for o, s in zip(req.storage_offsets, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(req.storage_offsets, req.lengths, strides, strict=True))
        n_elems = last - first + 1 if all(n > 0 for n in req.lengths) else 0
        start = loc.byte_offset + first * loc.dtype.itemsize
        return loc, start, start + n_elems * loc.dtype.itemsize

    def load(self, flat: dict[str, torch.Tensor], planner: LoadPlanner) -> None:
        """Read this checkpoint into `flat` as `dcp.load` would, without its central planning: DCP's load planner
        maps the saved chunks onto this rank's tensors with no global step (its global load plan is the ranks' own),
        so the plans' gather to rank 0 and scatter back, and the closing gather, are left out (trainer/checkpoint/
        DESIGN.md, Loading). A collective over the engine's group: one all-reduce, in `_read_agreed`."""
        plan: LoadPlan | None = None
        failure: CheckpointError | None = None
        try:
            planner.set_up_planner(flat, self.metadata, self.comm.rank == 0)
            plan = planner.finish_plan(self.prepare_local_plan(planner.create_local_plan()))
        except Exception as e:  # adapter boundary (DCP's planner): every rank hears of it in `_read_agreed`
            failure = CheckpointError(f"loading {self.path} failed: planning the reads: {type(e).__name__}: {e}")
        self._read_agreed(plan, planner, failure)

    def _read_agreed(self, plan: LoadPlan | None, planner: LoadPlanner, failure: CheckpointError | None) -> None:
        """Read and verify `plan`'s bytes; once every rank's reads verified, copy them into the planner's tensors.
        Every rank raises when any rank failed, the same kind of error (corrupt first, then the durable tier's)."""
        ready: list[tuple[Any, torch.Tensor]] = []
        error = failure
        if error is None and plan is not None:
            try:
                ready = self._read_verified(plan)
            except CheckpointError as e:
                error = e
            except OSError as e:
                error = CheckpointCorruptError(f"{self.path}: {e}", path=str(self.path))
        # Every rank verifies its bytes before any rank copies one: nothing partially loaded.
        agreed = self.comm.all_reduce_max(_severity(error))
        if agreed:
            if error is not None and _severity(error) == agreed:
                raise error
            if agreed == _CORRUPT:
                raise CheckpointCorruptError(
                    f"{self.path}: another rank found a corrupt or unreadable shard", path=str(self.path)
                )
            if agreed == _TIER:
                raise DurableTierError(f"{self.path}: another rank's reads from the durable tier failed")
            raise CheckpointError(f"loading {self.path} failed on another rank")
        with torch.no_grad():
            for req, src in ready:
                target = planner.resolve_tensor(req).detach()
                target.copy_(src)
                planner.commit_tensor(req, target)

    def _read_verified(self, plan: LoadPlan) -> list[tuple[Any, torch.Tensor]]:
        by_file: dict[str, list[tuple[Any, ChunkLocation, int, int]]] = {}
        for req in plan.items:
            loc, start, end = self._range(req)
            by_file.setdefault(loc.file, []).append((req, loc, start, end))
        files, read = [], []
        regions_of: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for file, reqs in by_file.items():
            crc_file = reqs[0][1].crc_file
            if file in self.kept:
                regions_of[file] = list(self.kept[file])
                continue
            if self.held is not None and not {file, crc_file} <= self.held:
                raise CheckpointCorruptError(
                    f"{self.path}: {file} is not in this copy: the restore fetched only the files its load plan "
                    "read, and this load reads another",
                    path=str(self.path),
                    file=file,
                )
            if self.source is not None:
                vf = self.source.verified_file(file, crc_file)
            else:
                vf = VerifiedFile.in_checkpoint(self.path, self.manifest, file, crc_file)
            files.append((vf, [(s, e) for _, _, s, e in reqs]))
            read.append(file)
        if self.source is None:
            got = read_files(files, pool=self.pool)
        else:
            got = read_files(files, threads=self.source.threads, piece=self.source.piece)
        for file, (vf, _), regions in zip(read, files, got, strict=True):
            self.bytes_read += vf.bytes_read
            regions_of[file] = regions
        ready = []
        for file, reqs in by_file.items():
            regions = regions_of[file]
            for req, loc, s, e in reqs:
                if e == s:
                    ready.append((req, torch.empty(tuple(req.lengths), dtype=loc.dtype)))
                    continue
                base, region = next(((b, r) for b, r in regions if b <= s and e <= b + r.numel()), (-1, None))
                if region is None:  # a region held (`kept`) that does not cover what the plan reads now
                    raise CheckpointCorruptError(f"{self.path}: bytes {s}..{e} of {file} are not held", file=file)
                span = region[s - base : e - base].view(loc.dtype)
                src = span.as_strided(tuple(req.lengths), _contiguous_strides(loc.sizes), span.storage_offset())
                ready.append((req, src))
        return ready


_OTHER, _TIER, _CORRUPT = 1, 2, 3


def _severity(error: CheckpointError | None) -> int:
    """What a rank's failure counts for in the agreement: 0 none; a corrupt file outranks the durable tier."""
    if error is None:
        return 0
    if isinstance(error, CheckpointCorruptError):
        return _CORRUPT
    return _TIER if isinstance(error, DurableTierError) else _OTHER


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))
