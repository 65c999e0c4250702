"""The torch side of `ftsup bench scale`: the engine's save plan, its commit metadata and its resharded load plan
over N simulated ranks, and DCP's own planner and metadata on the same state (the peer rows), every rank's work in
this one process through the product's functions. An operation's time is its critical path (`Timed.critical_s`);
what crosses ranks is pickled as `torch.distributed`'s object collectives do.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ftsup.store import dcpmeta, layout
from ftsup.store.retention import RetentionPolicy
from ftsup.tools.bench.scale.state import Job, rank_report, write_rank_files
from ftsup.trainer.checkpoint import loadplan, saveplan, staging
from ftsup.trainer.checkpoint.commit import Committer, StagedSave
from ftsup.trainer.checkpoint.reader import ShardReader


@dataclass
class Timed:
    """One simulated collective operation: seconds before, at and after the coordinator."""

    ranks_before_s: list[float] = field(default_factory=list)
    coordinator_s: float = 0.0
    ranks_after_s: list[float] = field(default_factory=list)

    @property
    def critical_s(self) -> float:
        return max(self.ranks_before_s, default=0.0) + self.coordinator_s + max(self.ranks_after_s, default=0.0)


class SimComm:
    """The coordinator's view of the engine's comm (`comm.GroupComm`): rank 0 of `world_size`."""

    rank = 0
    group = None

    def __init__(self, world_size: int):
        self.world_size = world_size


@dataclass
class Planned:
    """What a first save's planning left: rank 0's plan, every rank's shard file size, DCP's metadata."""

    plan0: staging.StagingPlan
    shard_bytes: list[int]
    metadata: Metadata | None
    timed: Timed


def save_plan_first(job: Job, *, dcp_only: bool = False) -> Planned:
    """The engine's first save plan (`staging.make_plan` on every rank: the compact plan, `saveplan`); `dcp_only`:
    DCP's `DefaultSavePlanner` alone (what `dcp.save` plans on every save without its plan cache: local plans,
    gather, global plan, scatter), the peer row."""
    if not dcp_only:
        return _compact_plan_first(job)
    t = Timed()
    gathered: list[bytes] = []
    planner0 = None
    for rank in range(job.world_size):
        t0 = time.perf_counter()
        planner, local = staging.plan_local(job.rank_state(rank), rank == 0)
        gathered.append(pickle.dumps(local))
        t.ranks_before_s.append(time.perf_counter() - t0)
        if rank == 0:
            planner0 = planner
    assert planner0 is not None
    t0 = time.perf_counter()
    plans: list[SavePlan] = [pickle.loads(b) for b in gathered]
    del gathered
    per_rank, metadata = planner0.create_global_plan(plans)
    del plans
    scattered = [pickle.dumps(p) for p in per_rank]
    del per_rank
    t.coordinator_s = time.perf_counter() - t0
    for raw in scattered:
        t0 = time.perf_counter()
        planner0.finish_plan(pickle.loads(raw))
        t.ranks_after_s.append(time.perf_counter() - t0)
    return Planned(None, [], metadata, t)  # type: ignore[arg-type]


def _compact_plan_first(job: Job) -> Planned:
    """`staging.make_plan`'s compact path over N simulated ranks: items, gather, `compact_global`, scatter,
    `compact_finish`."""
    t = Timed()
    gathered: list[bytes] = []
    for rank in range(job.world_size):
        t0 = time.perf_counter()
        items = saveplan.local_items(job.rank_state(rank))
        if items is None:
            raise RuntimeError("the simulated state fell back to DCP's planner")
        gathered.append(pickle.dumps(items))
        t.ranks_before_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    chunks, head = staging.compact_global([pickle.loads(b) for b in gathered])
    del gathered
    scattered = [pickle.dumps((c,)) for c in chunks]
    del chunks
    t.coordinator_s = time.perf_counter() - t0
    sizes: list[int] = []
    plan0 = None
    for rank, raw in enumerate(scattered):
        t0 = time.perf_counter()
        plan = staging.compact_finish((), pickle.loads(raw)[0], head if rank == 0 else None)
        sizes.append(plan.layout.total_size)
        plan0 = plan if rank == 0 else plan0
        t.ranks_after_s.append(time.perf_counter() - t0)
    return Planned(plan0, sizes, None, t)  # type: ignore[arg-type]


def save_plan_cached(job: Job, planned: Planned) -> float:
    """A later save's plan on the rank with the most tensors: the state's signature, compared with the cached
    plan's (`CheckpointEngine._save`); every rank does the same at once, and nothing crosses ranks."""
    rank = max(range(0, job.world_size, job.dp), key=lambda r: len(job.rank_state(r)))
    flat = job.rank_state(rank)
    cached = staging.signature(flat)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    if staging.signature(flat) != cached:  # type: ignore[arg-type]
        raise RuntimeError("the signature of an unchanged state changed")
    return time.perf_counter() - t0


def committer(directory: Path, world_size: int) -> Committer:
    comm: Any = SimComm(world_size)
    return Committer(
        directory,
        comm,
        o_direct=False,
        retention=RetentionPolicy(keep_last=1 << 30),
        recycle=False,
        hook=lambda point, step: None,
    )


def commit(directory: Path, job: Job, planned: Planned, step: int, *, files: bool = False) -> Timed:
    """One commit of `step` under `directory` (`Committer._commit` on rank 0, after the gather of every rank's
    files, sizes and checksums); `files`: every rank's files are there too (sparse), a consistent checkpoint."""
    partial = directory / layout.partial_dirname(step)
    os.mkdir(partial)
    reports = [rank_report(r, planned.shard_bytes[r]) for r in range(job.world_size)]
    if files:
        for r in reports:
            write_rank_files(str(partial), r)
    t = Timed()
    sent = []
    for r in reports:
        t0 = time.perf_counter()
        sent.append(pickle.dumps(r))
        t.ranks_before_s.append(time.perf_counter() - t0)
    del reports
    # Rank 0's skeleton (`codec.flatten`): its tensors by name, and the step.
    skeleton = {"d": [*([k, {"T": k}] for k in job.rank_state(0)), ["step", {"v": step}]]}
    no_buffer: Any = None  # `_commit` never reads the staged buffer: the shards are written before it
    staged = StagedSave(
        step, "periodic", no_buffer, lambda: None, planned.plan0, skeleton, b"", {"step": step}, 0.0, 0.0, None, None
    )
    final = directory / layout.step_dirname(step)
    t0 = time.perf_counter()
    outcome = committer(directory, job.world_size)._commit(staged, partial, final, [pickle.loads(b) for b in sent])
    t.coordinator_s = time.perf_counter() - t0
    if not outcome["ok"]:
        raise RuntimeError(f"the commit of step {step} failed: {outcome['error']}")
    return t


def dcp_commit(directory: Path, job: Job, planned: Planned, step: int) -> Timed:
    """DCP's commit metadata, the peer row: every rank's write results gathered, `FileSystemWriter.finish`
    (the merged metadata pickled into `.metadata`, fsynced, renamed)."""
    assert planned.metadata is not None
    path = directory / f"dcp-{step}"
    os.mkdir(path)
    by_rank: dict[int, list[WriteResult]] = {}
    for index, (rank, offset, length) in _storage_items(planned.metadata, job):
        info = _StorageInfo(f"__{rank}_0.distcp", offset, length)
        by_rank.setdefault(rank, []).append(WriteResult(index, length, info))
    t = Timed()
    sent = []
    for rank in range(job.world_size):
        t0 = time.perf_counter()
        sent.append(pickle.dumps(by_rank.get(rank, [])))
        t.ranks_before_s.append(time.perf_counter() - t0)
    del by_rank
    writer = FileSystemWriter(str(path), sync_files=True)
    writer.reset()
    writer.set_up_storage_writer(True)
    t0 = time.perf_counter()
    writer.finish(planned.metadata, [pickle.loads(b) for b in sent])
    t.coordinator_s = time.perf_counter() - t0
    return t


def _storage_items(metadata: Metadata, job: Job) -> list[tuple[Any, tuple[int, int, int]]]:
    """Every saved chunk's index and (writing rank, offset, length) in a DCP checkpoint of `job`."""
    out = []
    itemsize = job.model.dtype.itemsize
    offsets: dict[int, int] = {}
    rank_of = {}
    for rank in range(job.world_size):
        for fqn, shard in job.rank_state(rank).items():
            rank_of[(fqn, shard.offsets)] = rank
    for fqn, md in metadata.state_dict_metadata.items():
        for c in md.chunks:  # type: ignore[union-attr]
            rank = rank_of[(fqn, tuple(c.offsets))]
            n = itemsize
            for s in c.sizes:
                n *= s
            out.append((MetadataIndex(fqn, c.offsets), (rank, offsets.get(rank, 0), n)))
            offsets[rank] = offsets.get(rank, 0) + n
    return out


def load_plan(path: Path, job: Job, to_world: int, sample: int = 3) -> Timed:
    """A resharded load plan from `job`'s checkpoint at `path` onto `to_world` ranks (`loading._load_from`'s
    planning): rank 0 reads and checks the DCP metadata and broadcasts it packed by tensor (`loadplan.pack`); each
    loading rank builds its `ShardReader` over its own tensors' chunks and DCP's `DefaultLoadPlanner` local plan.
    `sample` loading ranks are planned (spread over the stages; every rank's part is alike), the slowest counted."""
    target = Job(job.model, to_world, job.pp)
    t = Timed()
    t0 = time.perf_counter()
    manifest = layout.read_manifest(path)
    meta = dcpmeta.read(path, manifest)
    sent = pickle.dumps((manifest, loadplan.pack(meta)))
    del meta
    t.coordinator_s = time.perf_counter() - t0
    for rank in _spread(to_world, sample):
        t0 = time.perf_counter()
        got_manifest, got_meta = pickle.loads(sent)
        flat = target.rank_state(rank)
        reader = ShardReader(path, got_manifest, got_meta, SimComm(to_world), names=flat)  # type: ignore[arg-type]
        _load_planner(flat, reader.metadata, rank == 0).create_local_plan()
        t.ranks_after_s.append(time.perf_counter() - t0)
    return t


def dcp_load_plan(path: Path, job: Job, to_world: int, sample: int = 3) -> Timed:
    """DCP's own resharded load plan, the peer row: each loading rank reads `.metadata` (`FileSystemReader`)
    and plans with `DefaultLoadPlanner`."""
    target = Job(job.model, to_world, job.pp)
    t = Timed()
    for rank in _spread(to_world, sample):
        t0 = time.perf_counter()
        metadata = FileSystemReader(str(path)).read_metadata()
        _load_planner(target.rank_state(rank), metadata, rank == 0).create_local_plan()
        t.ranks_after_s.append(time.perf_counter() - t0)
    return t


def _load_planner(flat: dict[str, Any], metadata: Metadata, coordinator: bool) -> DefaultLoadPlanner:
    """The engine's load planner set up for `flat`. Its set-up maps the state's tensors (materialising meta
    tensors) and turns anything else into None, a SimShard included: the simulated shards are put back."""
    planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=False)
    planner.set_up_planner(dict(flat), metadata, coordinator)
    planner.state_dict = flat  # type: ignore[assignment]
    return planner


def _spread(world: int, n: int) -> list[int]:
    return sorted({(world - 1) * i // max(1, n - 1) for i in range(n)})
