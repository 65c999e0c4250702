"""CheckpointEngine: sharded, asynchronous, atomic, verified, reshardable checkpoints.

It owns the staging buffers (bounded, reused), the writer thread and its futures, and how failures surface; what a
save and a load do, step by step: trainer/checkpoint/DESIGN.md, "A save, step by step".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch

from ftsup import memtier
from ftsup.store import blocksum, layout, saving
from ftsup.store.errors import CheckpointError, CheckpointSaveError
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer.checkpoint import codec, devcopy, gcpause, loading, peerload, peers, rankenv, shardio, staging
from ftsup.trainer.checkpoint import memory as memtiers
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm, make_comm
from ftsup.trainer.checkpoint.commit import Committer, Hook, SaveResult, StagedSave, log_quietly
from ftsup.trainer.checkpoint.freshoptim import clear_made, flat_state
from ftsup.trainer.checkpoint.loading import LoadResult, read_rank_state
from ftsup.trainer.checkpoint.shardio import aligned_buffer

__all__ = ["CheckpointEngine", "Hook", "LoadResult", "SaveHandle", "SaveResult", "read_rank_state"]

log = structlog.get_logger("ftsup.checkpoint")


class SaveHandle:
    def __init__(self, future: Future[SaveResult], reported: Callable[[BaseException], None] = lambda e: None):
        self._future = future
        self._reported = reported

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """The save's result; raises CheckpointSaveError if it failed (then `engine.wait()` does not
        raise it again)."""
        try:
            return self._future.result(timeout)
        except CheckpointError as e:
            self._reported(e)
            raise


@functools.cache
def _warn_if_checksums_are_slow() -> None:
    """Once per process: say so when block checksums run in pure Python (the C extension is
    not built). Saves and loads stay correct, but checksumming then takes seconds per GiB and
    holds the GIL, so training stalls during every save."""
    if blocksum.implementation() == "python":
        log.warning(
            "checkpoint_checksums_slow",
            implementation="python",
            reason="the C extension ftsup.store._blocksum is not built; reinstall ftsup with a C "
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

    `recycle`: shard files of checkpoints that retention deletes are kept (one save's worth, in
    `.recycle/`) and written over by the next save, which the filesystem does faster than new
    files (see `retention.RECYCLE_DIRNAME`). False deletes them.

    `check_finite` (default True): a save whose staged state holds a NaN or an infinity in a
    floating tensor fails, naming the tensor, and nothing is committed (`finite`). False: for a
    state that holds infinities on purpose (a mask kept as a float buffer).

    `retention` (default: `RetentionPolicy()`) keeps at least the history the supervisor asks for in
    `FTSUP_KEEP_OLDER_THAN_STEPS` (`RetentionPolicy.with_environment`: a rollback past an anomaly
    needs a checkpoint from before its onset); a bad value of it is a CheckpointError naming it.

    `durable_tier`: a durable tier's location (`s3://BUCKET/PREFIX` or a path) that `load` reads a checkpoint from
    when it is newer than the local store's consistent ones, or when a step asked for is not consistent here
    (`ftsup.store.tiers`); "auto" (the default): `FTSUP_CHECKPOINT_DURABLE`, which `ftsup run` sets from
    `checkpoint.durable`; None: none. Saves go to `directory` only.

    `fallback_dir`: where an emergency save that `directory` refused (full, gone, read-only) is written again,
    from the same staged state, before its handle fails; its result says `fallback`. It is no resume point by
    itself: the supervisor copies it to the durable tier. "auto" (the default): `FTSUP_CHECKPOINT_FALLBACK_DIR`,
    which `ftsup run` sets from `checkpoint.durable.fallback_dir`; None: none.

    `memory`: the node's memory tier (a tmpfs directory, or a `ftsup.memtier.MemoryTier` with its `keep_last`), where
    every save the store committed is committed again, and which `load` reads when it holds the checkpoint chosen,
    verified (trainer/checkpoint/DESIGN.md, The memory tier). "auto" (the default):
    `FTSUP_CHECKPOINT_MEMORY`, which `ftsup run` sets from `checkpoint.memory`; None: none.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        process_group: Any = "auto",
        max_in_flight: int = 1,
        retention: RetentionPolicy | None = None,
        o_direct: bool = True,
        recycle: bool = True,
        hook: Hook | None = None,
        check_finite: bool = True,
        durable_tier: str | None = "auto",
        fallback_dir: str | os.PathLike[str] | None = "auto",
        memory: memtier.MemoryTier | str | os.PathLike[str] | None = "auto",
    ):
        if max_in_flight < 1:
            raise CheckpointError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.directory = Path(directory)
        self.durable_tier = rankenv.durable_tier() if durable_tier == "auto" else durable_tier
        self._hook = hook or (lambda point, step: None)
        policy = (retention if retention is not None else RetentionPolicy()).with_environment(os.environ)
        _warn_if_checksums_are_slow()
        self._comm: LocalComm | GroupComm = make_comm(process_group)
        self.rank = self._comm.rank
        self.world_size = self._comm.world_size
        node, leader = rankenv.node()
        # The store and the fallback directory are written alike; their retention and recycling differ.
        committer = functools.partial(
            Committer,
            comm=self._comm,
            o_direct=o_direct,
            hook=self._hook,
            check_finite=check_finite,
            node=node,
            leader=leader,
        )
        self._committer = committer(self.directory, retention=policy, recycle=recycle)
        if self._committer.leader:
            self.directory.mkdir(parents=True, exist_ok=True)
        fallback = rankenv.fallback_dir() if fallback_dir == "auto" else fallback_dir
        self._fallback: Committer | None = None
        if fallback is not None:  # one emergency checkpoint at a time is kept there
            self._fallback = committer(Path(fallback), retention=RetentionPolicy(keep_last=1), recycle=False)
            if self._fallback.leader:  # made now, as the store is; where it cannot be, its one save says why
                with contextlib.suppress(OSError):
                    self._fallback.directory.mkdir(parents=True, exist_ok=True)
        if memory == "auto":
            memory = rankenv.memory_tier()
        elif memory is not None and not isinstance(memory, memtier.MemoryTier):
            memory = memtier.MemoryTier(os.path.abspath(os.fspath(memory)))
        self._memory, self._ring = None, None
        if memory is not None:
            self._memory, self._ring = memtiers.open_tier(memory, self._comm, *rankenv.node_id())
        self._plan: staging.StagingPlan | None = None
        self._buffers: list[torch.Tensor | None] = [None] * max_in_flight
        self._host = devcopy.HostBuffers()  # CUDA state's page-locked buffers (none for CPU state)
        self._side = devcopy.SideStreams()
        self._fence = devcopy.UpdateFence()
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(max_in_flight):
            self._free.put(i)
        self._jobs: queue.Queue[StagedSave | None] = queue.Queue()
        self._in_flight: list[Future[SaveResult]] = []
        self._failure: BaseException | None = None  # the first failure no handle has raised yet
        self.failed_saves = 0
        """Saves that failed since the engine was made (each also logged: checkpoint_save_failed)."""
        self._lock = threading.Lock()
        self._reading: ThreadPoolExecutor | None = None  # made by the first load, kept until close
        self._closed = False
        self._writer = threading.Thread(target=self._writer_loop, name="ftsup-ckpt-writer", daemon=True)
        self._writer.start()

    @property
    def retention(self) -> RetentionPolicy:
        return self._committer.retention

    @property
    def o_direct(self) -> bool:
        return self._committer.o_direct

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish in-flight saves and stop the writer thread. A save that failed was logged and
        counted, and its handle raises it; closing does not (call `wait()` first to hear of it)."""
        if self._closed:
            return
        try:
            self._drain()
        finally:
            self._closed = True
            self._jobs.put(None)
            self._writer.join()
            self._fence.close()
            self._host.close()
            if self._reading is not None:
                self._reading.shutdown(wait=True)
                self._reading = None
            if self._plan is not None:
                self._plan.views.clear()
            self._buffers = [None] * len(self._buffers)  # the staging memory goes with the engine, not its owner

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait(self) -> None:
        """Block until every in-flight save has finished; raise the first failure that no handle
        has raised yet, once."""
        self._drain()
        self._raise_failure()

    def fence(self) -> None:
        """Make the current CUDA stream wait for the copies of the saves in flight: a wait on the device, the host goes
        on. Every torch optimizer's `step()` does this first by itself (so a save holds the state of its call);
        call it before anything else writes the saved tensors in place, such as a forward that updates BatchNorm's
        running statistics. A no-op without CUDA state."""
        self._fence.fence()

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

    def _reported(self, failure: BaseException) -> None:
        with self._lock:
            if self._failure is failure:
                self._failure = None

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

        Returns a SaveHandle, or the SaveResult when `block=True` (final and emergency saves;
        raises CheckpointSaveError when that save fails). An earlier background save's failure is
        not raised here: it was logged and counted, and its own handle raises it.
        """
        with gcpause.paused():
            return self._save(step, state, kind, rank_state, metadata, block)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        kind: str,
        rank_state: Any,
        metadata: Mapping[str, Any] | None,
        block: bool,
    ) -> SaveHandle | SaveResult:
        if self._closed:
            raise CheckpointError("save() on a closed CheckpointEngine")
        if kind not in layout.KINDS:
            raise CheckpointError(f"kind must be one of {', '.join(layout.KINDS)}, got {kind!r}")
        t0 = time.perf_counter()
        flat, skeleton = codec.flatten(codec.state_dicts(state))
        rank_state_bytes = json.dumps(codec.encode_inline(rank_state)).encode()
        meta = dict(metadata or {})
        json.dumps(meta)  # fail now, in the caller, if it is not JSON
        signature = staging.signature(flat)
        if self._plan is None or self._plan.signature != signature:
            self.wait()  # planning uses the engine's group: the writer must be idle
            self._plan = staging.make_plan(flat, signature, self._comm)
            for old in self._buffers:
                self._host.drop(old)
            self._buffers = [None] * len(self._buffers)
        plan = self._plan
        cuda = staging.on_cuda(flat)
        buf_index = self._free.get()  # bounds saves in flight and host memory
        if self._committer.leader:  # the supervisor holds the durable upload while a save runs (`saving`)
            saving.mark_staging(self.directory, step)
        try:
            buf = self._buffer(buf_index, plan, cuda)
            buf, copies, crcs = staging.stage(plan, flat, buf, self._side if cuda else None)
        except BaseException:
            self._free.put(buf_index)
            if self._committer.leader:
                saving.clear_staging(self.directory, step)
            raise
        if copies is not None:
            self._fence.arm(copies)
        stage_s = time.perf_counter() - t0
        self._hook("staged", step)
        job = StagedSave(
            step,
            kind,
            buf,
            functools.partial(self._release, buf_index, copies),
            plan,
            skeleton,
            rank_state_bytes,
            meta,
            t0,
            stage_s,
            copies,
            crcs,
        )
        with self._lock:
            self._in_flight.append(job.future)
        self._jobs.put(job)
        handle = SaveHandle(job.future, self._reported)
        return handle.wait() if block else handle

    def _buffer(self, index: int, plan: staging.StagingPlan, cuda: bool) -> torch.Tensor:
        """Staging buffer `index` for `plan`: the one kept, or a new one (page-locked for CUDA state)."""
        buf = self._buffers[index]
        if buf is not None and (buf.numel() != plan.layout.total_size or cuda != self._host.holds(buf)):
            plan.views.pop(buf.data_ptr(), None)
            self._host.drop(buf)
            buf = self._buffers[index] = None
        buf = staging.host_buffer(plan, buf, self._host.allocate if cuda else aligned_buffer)
        self._buffers[index] = buf
        return buf

    def _release(self, index: int, copies: devcopy.Copies | None) -> None:
        """The writer is done with buffer `index`: once the copies into it have landed, the next save may use it."""
        if copies is not None:
            try:
                copies.landed()  # landed already, unless the save ended before its shard was written
            except Exception as e:  # adapter boundary (the CUDA runtime): the save's own error says more
                log_quietly(log.error, "checkpoint_copy_failed", rank=self.rank, reason=str(e))
        self._free.put(index)

    def _writer_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                result = self._write(job)
            except BaseException as e:
                err = e if isinstance(e, CheckpointError) else CheckpointSaveError(f"step {job.step}: {e}")
                with self._lock:
                    self._failure = self._failure or err
                    self.failed_saves += 1
                log_quietly(
                    log.error,
                    "checkpoint_save_failed",
                    step=job.step,
                    kind=job.kind,
                    rank=self.rank,
                    reason=str(err),
                    failed_saves=self.failed_saves,
                )
                job.future.set_exception(err)
                continue
            if not result.skipped:
                rankenv.report_duration(result)  # before the result: a caller woken by it beats after this
            job.future.set_result(result)
            if self._committer.leader and not result.skipped:
                (self._fallback if result.fallback and self._fallback else self._committer).retain(job.step)

    def _write(self, job: StagedSave) -> SaveResult:
        """Write and commit `job` into the store (`_write_store`) and into the memory tier, from the same staged
        buffer (released once, after the last write): an emergency save into the memory tier first, where it lands
        soonest before the eviction's deadline, any other once the store committed it (trainer/checkpoint/DESIGN.md,
        The memory tier)."""
        mem = self._memory
        if mem is None:
            return self._write_store(job)
        release, job.release = job.release, lambda: None
        try:
            if job.kind == "emergency":  # a failure in memory is logged; the store is tried all the same
                reached = self._write_memory(mem, job)
                return dataclasses.replace(self._write_store(job), tiers=reached)
            result = self._write_store(job)
            if not result.skipped and not result.fallback:
                result = dataclasses.replace(result, tiers=self._write_memory(mem, job))
            return result
        finally:
            release()

    def _write_memory(self, mem: Committer, job: StagedSave) -> tuple[str, ...]:
        """`job` committed in the memory tier, then replicated to the peers' memories: the tiers it reached."""
        if not memtiers.write(mem, job):
            return ()
        reached: tuple[str, ...] = (peers.MEMORY,)
        if self._ring is not None and any(self._ring.targets.values()):  # every rank alike
            assert isinstance(self._comm, GroupComm)
            if peers.replicate(self._ring, self._comm, mem.directory, job.step):
                reached += (peers.PEERS,)
                rankenv.report_memory(job.step, peers=True)
        return reached

    def _write_store(self, job: StagedSave) -> SaveResult:
        """Write and commit `job` into the store; an emergency save the store refused, into the fallback directory
        too, from the same staged buffer (released once, after the last try)."""
        fallback = self._fallback
        if fallback is None or job.kind != "emergency":
            return self._committer.write(job)
        release, job.release = job.release, lambda: None
        try:
            try:
                return self._committer.write(job)
            except CheckpointSaveError as e:  # every rank alike: the commit's outcome is broadcast
                where = str(fallback.directory)
                log_quietly(
                    log.error, "checkpoint_save_failed", step=job.step, kind=job.kind, reason=str(e), fallback=where
                )
            return dataclasses.replace(fallback.write(job), fallback=True)
        finally:
            release()

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
        self._drain()
        node_local = self._committer.node is not None
        if self._reading is None:
            # Kept from load to load: starting them is a part of a load (trainer/checkpoint/DESIGN.md, No central plan).
            self._reading = shardio.reading_pool()
        with gcpause.paused():
            started, restored = time.perf_counter(), None
            flat, fresh = flat_state(state)
            if self._memory is not None and step is None:
                # Several nodes: their parts, gathered. One node left of several (node-local stores): the parts its
                # own memory holds, the replicas of the nodes it lost among them (trainer/checkpoint/DESIGN.md).
                node = self._ring.node if self._ring is not None else self._committer.node
                if node is not None and (
                    self._ring is not None or (node_local and peerload.holds_peers(self._memory.directory))
                ):
                    restored = peerload.before_load(
                        self._comm, self._memory, node, self.directory, at_most, node_local, flat, self._reading
                    )
            try:
                return loading.load(
                    self.directory,
                    self._comm,
                    state,
                    step=step,
                    at_most=at_most,
                    check=check,
                    durable_tier=self.durable_tier,
                    node_local=node_local,
                    pool=self._reading,
                    memory=self._memory.directory if self._memory and not node_local and self._ring is None else None,
                    restored=restored,
                    started=started,
                    flat=flat,
                )
            except BaseException:
                clear_made(fresh)  # fresh again, not left with a state made to be loaded into
                raise
            finally:
                if restored is not None and self._memory is not None and self._memory.leader:
                    shutil.rmtree(restored.path.parent, ignore_errors=True)
