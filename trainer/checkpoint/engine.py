"""CheckpointEngine: sharded, asynchronous, atomic, verified, reshardable checkpoints.

What happens on `save(step, state)`:

1. (caller's thread) The state is split into tensors and a JSON skeleton (`codec`). The first
   time a state of this structure is saved, DCP's `DefaultSavePlanner` plans who writes what
   (replicated tensors are written once in total, spread across ranks by bytes; DTensor shards
   by their owners); the plan is cached until the structure changes.
2. (caller's thread) This rank's chunks are copied into a reused, page-aligned host buffer
   (pinned for CUDA) laid out as the shard file. This copy is the only blocking part; on CPU
   it computes the shard's block checksums in the same pass.
3. (writer thread) The buffer is written as `step-N.partial/shard-RRRRR.safetensors` (O_DIRECT
   where possible; checksummed from memory unless staging did it), fsynced; rank 0 gathers every rank's file list,
   writes the DCP metadata and `manifest.json`, fsyncs, renames to `step-N/`, fsyncs the parent.
   Any failure removes the `.partial` directory and surfaces on the next `save`/`wait`.

`load(state)` picks the latest consistent checkpoint (or a given step), checks that names,
shapes and dtypes match before touching anything, and lets DCP's `DefaultLoadPlanner` map the
saved chunks onto this rank's tensors (any world size). Our reader reads only the byte ranges
needed, verifies their checksums on every rank first, and only then copies. A corrupt newest
checkpoint is quarantined and the previous one is loaded.

Not here: choosing when to save (the training loop or the supervisor does), the contents of the
per-rank state (trainer.state), Hugging Face export.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from trainer.checkpoint import blocksum, codec, layout
from trainer.checkpoint.comm import GroupComm, LocalComm, make_comm
from trainer.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    NoCheckpointError,
)
from trainer.checkpoint.reader import ShardReader
from trainer.checkpoint.shardio import ShardLayout, aligned_buffer, as_memoryview, build_layout, write_shard

log = structlog.get_logger("ftsup.checkpoint")

DCP_META_NAME = "dcp_metadata.json"
Hook = Callable[[str, int], None]
"""Called as hook(point, step) at: staged, shard_written, metadata_written, manifest_written,
renamed. For fault-injection tests (e.g. SIGKILL at an exact point of the protocol)."""


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.safetensors"


def crc_name(rank: int) -> str:
    return f"shard-{rank:05d}.crc32"


def rank_state_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: str
    kind: str
    tensor_bytes: int  # bytes of tensor data this rank wrote
    stage_s: float  # the blocking part of save()
    durable_s: float  # from the call until committed and fsynced
    skipped: bool = False  # the step was already committed; nothing was written


@dataclass(frozen=True)
class LoadResult:
    step: int
    path: str
    kind: str
    saved_world_size: int
    metadata: Mapping[str, Any]
    rank_state: Any  # this rank's saved rank_state, or None (rank >= saved world size)
    bytes_read: int
    load_s: float


@dataclass
class _Plan:
    signature: tuple[Any, ...]
    layout: ShardLayout
    sources: list[tuple[str, tuple[int, ...]]]  # (fqn, chunk offsets) per layout slot
    meta_json: dict[str, Any] | None  # rank 0 only: DCP metadata + every rank's slots
    tensor_bytes: int


@dataclass
class _Job:
    step: int
    kind: str
    buf_index: int
    plan: _Plan
    skeleton: Any
    rank_state: bytes
    metadata: dict[str, Any]
    t0: float
    stage_s: float
    cuda_event: Any
    crcs: list[int] | None  # the shard's block checksums, when staging computed them
    future: Future[SaveResult] = field(default_factory=Future)


class SaveHandle:
    def __init__(self, future: Future[SaveResult]):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        return self._future.result(timeout)


def _state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state.items()}


def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


def _local_chunks(t: torch.Tensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if codec._is_dtensor(t):
        return [(tuple(c.offsets), tuple(c.sizes)) for c in t.__create_chunk_list__()]  # type: ignore[attr-defined]
    return [((0,) * t.dim(), tuple(t.shape))]


def _signature(flat: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """What the cached save plan depends on: names, global shapes, dtypes and how each tensor is
    split. A DTensor's local chunks follow from its mesh, placements and global shape (for this
    rank), which are much cheaper to compare than the chunk lists are to compute on every save."""
    return tuple(
        (k, True, tuple(t.shape), t.dtype, t.device_mesh, tuple(t.placements), tuple(t.to_local().shape))  # type: ignore[attr-defined]
        if codec._is_dtensor(t)
        else (k, False, tuple(t.shape), t.dtype)
        for k, t in flat.items()
    )


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if codec._is_dtensor(t) else t  # type: ignore[attr-defined]


def _log_quietly(method: Callable[..., Any], event: str, **fields: Any) -> None:
    """Log from the writer thread. A broken log sink (stderr closed, or a pipe whose reader
    died, e.g. with the supervisor) must not kill the thread that resolves every save's
    future: the training loop would then hang in its next save or wait instead of going on."""
    try:
        method(event, **fields)
    except (OSError, ValueError):  # ValueError: "I/O operation on closed file"
        pass


@functools.cache
def _warn_if_checksums_are_slow() -> None:
    """Once per process: say so when block checksums run in pure Python (the C extension is
    not built). Saves and loads stay correct, but checksumming then takes seconds per GiB and
    holds the GIL, so training stalls during every save."""
    if blocksum.implementation() == "python":
        log.warning(
            "checkpoint_checksums_slow",
            implementation="python",
            reason="the C extension trainer.checkpoint._blocksum is not built; reinstall ftsup with a C "
            "compiler and the Python headers available (pip install -e .) to checksum in hardware",
        )


class CheckpointEngine:
    """Save and load sharded checkpoints under `directory` (shared by all ranks).

    With torch.distributed initialised, constructing the engine is a collective call (it
    creates the engine's own gloo group), and every rank must call `save`/`load` with states of
    the same structure at the same steps.

    `process_group`: "auto" (the default) or None: a new gloo group over all ranks when
    torch.distributed is initialised, otherwise a single process. A ProcessGroup: the ranks of
    that group, used as is (from the writer thread too, so it must not be the training group).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        process_group: Any = "auto",
        max_in_flight: int = 1,
        retention: layout.RetentionPolicy | None = None,
        o_direct: bool = True,
        hook: Hook | None = None,
    ):
        if max_in_flight < 1:
            raise CheckpointError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.directory = Path(directory)
        self.retention = retention if retention is not None else layout.RetentionPolicy()
        self.o_direct = o_direct
        self._hook = hook or (lambda point, step: None)
        _warn_if_checksums_are_slow()
        self._comm: LocalComm | GroupComm = make_comm(process_group)
        self.rank = self._comm.rank
        self.world_size = self._comm.world_size
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._plan: _Plan | None = None
        self._buffers: list[torch.Tensor | None] = [None] * max_in_flight
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(max_in_flight):
            self._free.put(i)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._in_flight: list[Future[SaveResult]] = []
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._writer = threading.Thread(target=self._writer_loop, name="ftsup-ckpt-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish in-flight saves, stop the writer thread. Raises a pending save failure."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._jobs.put(None)
            self._writer.join()

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self) -> None:
        """Block until every in-flight save has finished; raise the first failure, once."""
        self._drain()
        self._raise_failure()

    def _drain(self) -> None:
        with self._lock:
            pending = list(self._in_flight)
        for fut in pending:
            try:
                fut.result()
            except BaseException:  # noqa: S110 - recorded in self._failure by the writer
                pass

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
            self._in_flight = [f for f in self._in_flight if not f.done()]
        if failure is not None:
            raise CheckpointSaveError(f"an earlier checkpoint save failed: {failure}") from failure

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        kind: str = "periodic",
        rank_state: Any = None,
        metadata: Mapping[str, Any] | None = None,
        block: bool = False,
    ) -> SaveHandle | SaveResult:
        """Stage `state` and write it in the background as checkpoint `step`.

        Returns a SaveHandle, or the SaveResult when `block=True` (final and emergency saves).
        Raises CheckpointSaveError if an earlier background save failed.
        """
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointEngine")
        if kind not in layout.KINDS:
            raise CheckpointError(f"kind must be one of {', '.join(layout.KINDS)}, got {kind!r}")
        t0 = time.perf_counter()
        self._raise_failure()
        flat, skeleton = codec.flatten(_state_dicts(state))
        rank_state_bytes = json.dumps(codec.encode_inline(rank_state)).encode()
        meta = dict(metadata or {})
        json.dumps(meta)  # fail now, in the caller, if it is not JSON
        signature = _signature(flat)
        if self._plan is None or self._plan.signature != signature:
            self.wait()  # planning uses the engine's group: the writer must be idle
            self._plan = self._make_plan(flat, signature)
            self._buffers = [None] * len(self._buffers)
        plan = self._plan
        buf_index = self._free.get()  # bounds saves in flight and host memory
        try:
            buf, event, crcs = self._stage(plan, flat, buf_index)
        except BaseException:
            self._free.put(buf_index)
            raise
        stage_s = time.perf_counter() - t0
        self._hook("staged", step)
        job = _Job(step, kind, buf_index, plan, skeleton, rank_state_bytes, meta, t0, stage_s, event, crcs)
        with self._lock:
            self._in_flight.append(job.future)
        self._jobs.put(job)
        handle = SaveHandle(job.future)
        if not block:
            return handle
        try:
            return handle.wait()
        except CheckpointSaveError:
            with self._lock:  # reported here; do not raise it a second time on the next call
                self._failure = None
            raise

    def _make_plan(self, flat: dict[str, torch.Tensor], signature: tuple[Any, ...]) -> _Plan:
        planner = DefaultSavePlanner(flatten_state_dict=False)
        planner.set_up_planner(flat, None, self.rank == 0)
        local = planner.create_local_plan()
        gathered = self._comm.gather(local)
        meta_json: dict[str, Any] | None = None
        per_rank: list[SavePlan] | None = None
        if self.rank == 0:
            assert gathered is not None
            per_rank, metadata = planner.create_global_plan(gathered)
            meta_json = _metadata_to_json(metadata, [_plan_chunks(p) for p in per_rank])
        mine = planner.finish_plan(self._comm.scatter(per_rank))
        chunks = _plan_chunks(mine)
        shard = build_layout(chunks)
        sources = [(s.fqn, s.offsets) for s in shard.slots]
        nbytes = sum(s.nbytes for s in shard.slots)
        return _Plan(signature, shard, sources, meta_json, nbytes)

    def _stage(
        self, plan: _Plan, flat: dict[str, torch.Tensor], index: int
    ) -> tuple[torch.Tensor, Any, list[int] | None]:
        """Copy this rank's chunks into staging buffer `index`: (buffer, CUDA event, block CRCs).

        On CPU with hardware CRC-32C the block checksums are computed by the copy itself (one
        pass over the bytes, see blocksum.StreamingBlocks); otherwise they are None and the
        writer thread computes them from the buffer.
        """
        cuda = any(_local_tensor(t).is_cuda for t in flat.values())
        buf = self._buffers[index]
        if buf is None or buf.numel() != plan.layout.total_size:
            buf = aligned_buffer(plan.layout.total_size, pin=cuda)
            buf[: plan.layout.data_start].copy_(torch.frombuffer(bytearray(plan.layout.header), dtype=torch.uint8))
            self._buffers[index] = buf
        sums = None
        if not cuda and blocksum.fused_copy_available():
            sums = blocksum.StreamingBlocks(plan.layout.total_size)
            mv = as_memoryview(buf)
            sums.update(mv[: plan.layout.data_start], 0)
        with torch.no_grad():
            for slot, (fqn, offsets) in zip(plan.layout.slots, plan.sources, strict=True):
                src = _local_tensor(flat[fqn]).detach()
                if tuple(src.shape) != slot.sizes:
                    # The signature matched, so this is a chunk narrower than the local tensor.
                    src = _narrow(src, offsets, flat[fqn], slot.sizes)
                if slot.nbytes == 0:
                    continue
                start, end = slot.byte_offset, slot.byte_offset + slot.nbytes
                if sums is None:
                    buf[start:end].view(slot.dtype).view(slot.sizes).copy_(src, non_blocking=cuda)
                    continue
                raw = _raw_bytes(src, slot.dtype)
                if raw is not None:
                    sums.copy(mv[start:end], raw, start)
                else:  # a layout only torch copies: copy, then checksum the copy
                    buf[start:end].view(slot.dtype).view(slot.sizes).copy_(src)
                    sums.update(mv[start:end], start)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return buf, event, None if sums is None else sums.finish()

    # ------------------------------------------------------------------ writer thread

    def _writer_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                result = self._write_job(job)
            except BaseException as e:
                err = e if isinstance(e, CheckpointError) else CheckpointSaveError(f"step {job.step}: {e}")
                with self._lock:
                    self._failure = err
                job.future.set_exception(err)
                _log_quietly(log.error, "checkpoint_save_failed", step=job.step, rank=self.rank, reason=str(err))
                continue
            job.future.set_result(result)
            if self.rank == 0 and not result.skipped:
                self._retain(job.step)

    def _retain(self, newest: int) -> None:
        try:
            layout.apply_retention(self.directory, self.retention, protect={newest})
        except OSError as e:
            # A failed deletion must not fail a committed save; the next commit retries.
            _log_quietly(log.warning, "checkpoint_retention_failed", step=newest, reason=str(e))

    def _write_job(self, job: _Job) -> SaveResult:
        step, comm = job.step, self._comm
        root = self.directory
        partial = root / layout.partial_dirname(step)
        final = root / layout.step_dirname(step)
        try:
            prep: dict[str, Any] | None = None
            if self.rank == 0:
                prep = self._prepare_partial(step, partial, final)
            prep = comm.broadcast(prep)
            if prep.get("skip"):
                return SaveResult(step, str(final), job.kind, 0, job.stage_s, 0.0, skipped=True)
            if "error" in prep:
                raise CheckpointSaveError(f"step {step}: cannot prepare {partial}: {prep['error']}")
            report = self._write_rank_files(job, partial)
        finally:
            self._free.put(job.buf_index)
        reports = comm.gather(report)
        outcome: dict[str, Any] | None = None
        if self.rank == 0:
            assert reports is not None
            outcome = self._commit(job, partial, final, reports)
        outcome = comm.broadcast(outcome)
        if not outcome["ok"]:
            raise CheckpointSaveError(f"step {step}: {outcome['error']}; the previous checkpoint is intact")
        durable_s = time.perf_counter() - job.t0
        if self.rank == 0:
            _log_quietly(
                log.info, "checkpoint_committed", step=step, kind=job.kind, world_size=self.world_size,
                duration_s=round(durable_s, 4), path=str(final),
            )  # fmt: skip
        return SaveResult(step, str(final), job.kind, job.plan.tensor_bytes, job.stage_s, durable_s)

    def _prepare_partial(self, step: int, partial: Path, final: Path) -> dict[str, Any]:
        try:
            if final.exists():
                return {"skip": True}  # nothing ever overwrites a committed checkpoint
            # The writer runs saves in order, so any .partial of this or an older step is torn.
            for e in os.scandir(self.directory):
                s = layout.parse_partial_dirname(e.name)
                if s is not None and s <= step:
                    shutil.rmtree(e.path, ignore_errors=True)
            partial.mkdir()
            layout.fsync_dir(self.directory)
            return {}
        except OSError as e:
            return {"error": f"{e.strerror or e} ({e.filename or partial})"}

    def _write_rank_files(self, job: _Job, partial: Path) -> dict[str, Any]:
        files: dict[str, dict[str, Any]] = {}
        try:
            if job.cuda_event is not None:
                job.cuda_event.synchronize()
            buf = self._buffers[job.buf_index]
            assert buf is not None
            shard = shard_name(self.rank)
            size, crcs = write_shard(str(partial / shard), buf, o_direct=self.o_direct, crcs=job.crcs)
            files[shard] = {"size": size, "checksum": layout.checksum_from_block_crcs(crcs)}
            packed = layout.pack_block_crcs(crcs)
            layout.write_file_durable(partial / crc_name(self.rank), packed)
            files[crc_name(self.rank)] = {"size": len(packed), "checksum": layout.checksum_bytes(packed)}
            layout.write_file_durable(partial / rank_state_name(self.rank), job.rank_state)
            files[rank_state_name(self.rank)] = {
                "size": len(job.rank_state),
                "checksum": layout.checksum_bytes(job.rank_state),
            }
            self._hook("shard_written", job.step)
            return {"ok": True, "files": files, "tensor_bytes": job.plan.tensor_bytes}
        except Exception as e:  # adapter boundary: every rank must still reach the gather
            msg = f"rank {self.rank}: {type(e).__name__}: {e}"
            _log_quietly(log.error, "checkpoint_write_failed", step=job.step, rank=self.rank, reason=msg)
            return {"ok": False, "error": msg}

    def _commit(self, job: _Job, partial: Path, final: Path, reports: list[dict[str, Any]]) -> dict[str, Any]:
        errors = [r["error"] for r in reports if not r["ok"]]
        try:
            if errors:
                raise CheckpointSaveError("; ".join(errors))
            assert job.plan.meta_json is not None
            files: dict[str, layout.FileEntry] = {}
            for r in reports:
                files.update({k: layout.FileEntry(v["size"], v["checksum"]) for k, v in r["files"].items()})
            meta = dict(job.plan.meta_json, skeleton=job.skeleton)
            raw = json.dumps(meta, separators=(",", ":")).encode()
            layout.write_file_durable(partial / DCP_META_NAME, raw)
            files[DCP_META_NAME] = layout.FileEntry(len(raw), layout.checksum_bytes(raw))
            self._hook("metadata_written", job.step)
            manifest = layout.Manifest(
                step=job.step, world_size=self.world_size, kind=job.kind, created_unix=time.time(),
                files=files, tensor_bytes=sum(r["tensor_bytes"] for r in reports), metadata=job.metadata,
            )  # fmt: skip
            layout.write_file_durable(partial / layout.MANIFEST_NAME, json.dumps(manifest.to_json(), indent=1).encode())
            layout.fsync_dir(partial)
            self._hook("manifest_written", job.step)
            os.rename(partial, final)
            layout.fsync_dir(self.directory)
            self._hook("renamed", job.step)
        except Exception as e:  # adapter boundary: report to every rank, leave no torn dir
            shutil.rmtree(partial, ignore_errors=True)
            return {"ok": False, "error": str(e)}
        return {"ok": True}

    # ------------------------------------------------------------------ load

    def load(
        self,
        state: Mapping[str, Any],
        *,
        step: int | None = None,
        at_most: int | None = None,
        check: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> LoadResult:
        """Restore `state` in place from checkpoint `step` (None: the latest consistent one).

        With `step=None`, a checkpoint that turns out corrupt while loading is quarantined
        (`step-N.corrupt`) and the next older one is tried. Raises NoCheckpointError when
        nothing consistent is left, CheckpointMismatchError when names, shapes or dtypes differ
        (before anything is modified). `check(manifest_metadata)` may raise to refuse a checkpoint
        before anything is modified (e.g. one from another model configuration). `at_most`: like
        `step=None` (with fallback), but only checkpoints of at most that step are considered; the
        supervisor passes its choice this way, so a checkpoint that fails is still skipped.
        """
        if self._closed:
            raise CheckpointError("load() on a closed CheckpointEngine")
        t0 = time.perf_counter()
        self._drain()
        dicts = _state_dicts(state)
        flat, _ = codec.flatten(dicts)
        while True:
            choice: dict[str, Any] | None = self._choose(step, at_most) if self.rank == 0 else None
            choice = self._comm.broadcast(choice)
            if "error" in choice:
                raise NoCheckpointError(choice["error"])
            try:
                return self._load_from(choice, state, flat, t0, check)
            except CheckpointCorruptError as e:
                if step is not None:
                    raise
                if self.rank == 0:
                    moved = layout.quarantine(self.directory, choice["step"])
                    log.error("checkpoint_quarantined", step=choice["step"], reason=str(e), path=str(moved))

    def _choose(self, step: int | None, at_most: int | None = None) -> dict[str, Any]:
        """Rank 0: the checkpoint to load and its verified DCP metadata (or why there is none)."""
        while True:
            try:
                if step is None and at_most is not None:
                    found = layout.latest_consistent(self.directory, below=at_most + 1)
                    if found is None:
                        raise NoCheckpointError(f"no consistent checkpoint of step <= {at_most} under {self.directory}")
                    info = found
                else:
                    info = layout.find_checkpoint(self.directory, step)
            except NoCheckpointError as e:
                return {"error": str(e)}
            if not info.consistent:
                problems = "; ".join(map(str, info.problems))
                if step is not None:
                    return {"error": f"checkpoint {info.path} is not consistent: {problems}"}
                moved = layout.quarantine(self.directory, info.step)
                log.error("checkpoint_quarantined", step=info.step, reason=problems, path=str(moved))
                continue
            manifest = layout.read_manifest(info.path)
            try:
                raw = layout.read_verified(info.path, manifest, DCP_META_NAME)
            except CheckpointCorruptError as e:
                if step is not None:
                    return {"error": str(e)}
                layout.quarantine(self.directory, info.step)
                continue
            return {"step": info.step, "path": info.path, "manifest": manifest.to_json(), "meta": json.loads(raw)}

    def _load_from(
        self,
        choice: dict[str, Any],
        state: Mapping[str, Any],
        flat: dict[str, torch.Tensor],
        t0: float,
        check: Callable[[Mapping[str, Any]], None] | None,
    ) -> LoadResult:  # fmt: skip
        path = Path(choice["path"])
        manifest = layout.parse_manifest(json.dumps(choice["manifest"]))
        meta = choice["meta"]
        if check is not None:
            check(manifest.metadata)  # the same metadata on every rank: all raise or none does
        mismatches = _mismatches(meta["tensors"], flat)
        rank_state: Any = None
        status = 0  # 0 fine, 1 corrupt, 2 mismatch: agreed by all ranks before any byte moves
        corrupt: CheckpointCorruptError | None = None
        if mismatches:
            status = 2
        else:
            try:
                rank_state = self._read_rank_state(path, manifest)
            except CheckpointCorruptError as e:
                status, corrupt = 1, e
        agreed = self._comm.all_reduce_max(status)
        if agreed == 2:
            shown = "; ".join(mismatches[:20]) or "(reported by another rank)"
            raise CheckpointMismatchError(
                f"checkpoint {path} does not fit the state being loaded ({len(mismatches)} mismatched keys): "
                f"{shown}; nothing was loaded",
                keys=[m.split(":")[0] for m in mismatches],
            )
        if agreed == 1:
            raise corrupt or CheckpointCorruptError(f"{path}: another rank found a corrupt file", path=str(path))
        reader = ShardReader(path, manifest, meta, self._comm)
        try:
            with warnings.catch_warnings():
                # A single process without torch.distributed is a supported mode, not a mistake.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load(
                    flat,
                    storage_reader=reader,
                    planner=DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=False),
                    process_group=self._comm.group,
                )
        except CheckpointException as e:
            for wrapped in e.failures.values():
                # DCP wraps each rank's error as (exception, stack)
                failure = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                if isinstance(failure, CheckpointCorruptError):
                    raise failure from None
            raise CheckpointError(f"loading {path} failed: {e}") from e
        rebuilt = codec.rebuild(meta["skeleton"], flat)
        for key, value in state.items():
            if _is_stateful(value):
                value.load_state_dict(rebuilt[key])
            elif isinstance(state, dict):
                state[key] = rebuilt[key]
        load_s = time.perf_counter() - t0
        log.info("checkpoint_loaded", step=manifest.step, rank=self.rank, duration_s=round(load_s, 4),
                 path=str(path), bytes_read=reader.bytes_read)  # fmt: skip
        return LoadResult(
            step=manifest.step, path=str(path), kind=manifest.kind, saved_world_size=manifest.world_size,
            metadata=manifest.metadata, rank_state=rank_state, bytes_read=reader.bytes_read, load_s=load_s,
        )  # fmt: skip

    def _read_rank_state(self, path: Path, manifest: layout.Manifest) -> Any:
        name = rank_state_name(self.rank)
        if name not in manifest.files:
            return None  # this rank did not exist when the checkpoint was saved
        return codec.decode_inline(json.loads(layout.read_verified(path, manifest, name)))


def read_rank_state(checkpoint_path: str | os.PathLike[str], rank: int) -> Any:
    """Any rank's saved rank_state (verified), e.g. to re-deal RNG streams on a new world size."""
    path = Path(checkpoint_path)
    manifest = layout.read_manifest(path)
    name = rank_state_name(rank)
    if name not in manifest.files:
        raise NoCheckpointError(f"{path} has no rank_state for rank {rank} (saved on {manifest.world_size})")
    return codec.decode_inline(json.loads(layout.read_verified(path, manifest, name)))


# ---------------------------------------------------------------------- planning helpers


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
    storage = []
    for rank, chunks in enumerate(per_rank_chunks):
        for slot in build_layout(chunks).slots:
            storage.append({
                "fqn": slot.fqn, "offsets": list(slot.offsets), "sizes": list(slot.sizes),
                "file": shard_name(rank), "crc_file": crc_name(rank),
                "byte_offset": slot.byte_offset, "nbytes": slot.nbytes,
            })  # fmt: skip
    return {"tensors": tensors, "storage": storage}


def _mismatches(saved: Mapping[str, Any], flat: Mapping[str, torch.Tensor]) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(flat)):
        if key not in flat:
            out.append(f"{key}: in the checkpoint but not in the state being loaded")
        elif key not in saved:
            out.append(f"{key}: in the state being loaded but not in the checkpoint")
        else:
            s, t = saved[key], flat[key]
            if list(t.shape) != s["size"]:
                out.append(f"{key}: shape {list(t.shape)} != saved {s['size']}")
            elif codec.dtype_name(t.dtype) != s["dtype"]:
                out.append(f"{key}: dtype {codec.dtype_name(t.dtype)} != saved {s['dtype']}")
    return out
