"""The writer side of a save: a staged buffer becomes a committed `step-N/`, in a shared store or in each node's own,
then retention (ftsup/store/DESIGN.md, The commit protocol).

Not here: staging (`staging`), the queue and the futures the training loop waits on (`engine`).
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from ftsup.store import checksums, choice, layout, nodes, saving
from ftsup.store.errors import CheckpointError, CheckpointSaveError, os_error_line
from ftsup.store.retention import RetentionPolicy, apply_retention, claim_spare, remove_dir
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.finite import first_nonfinite
from ftsup.trainer.checkpoint.shardio import write_shard
from ftsup.trainer.checkpoint.staging import StagingPlan, metadata_bytes

log = structlog.get_logger("ftsup.checkpoint")

Hook = Callable[[str, int], None]
"""Called as hook(point, step) at: staged, shard_written, metadata_written, manifest_written,
renamed. For fault-injection tests (e.g. SIGKILL at an exact point of the protocol)."""


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: str
    kind: str
    tensor_bytes: int  # bytes of tensor data this rank wrote
    stage_s: float  # the blocking part of save()
    durable_s: float  # from the call until committed and fsynced
    skipped: bool = False  # the step was already committed; nothing was written
    recreated: bool = False  # the store's directory had vanished, and this save made it again
    fallback: bool = False  # committed in the engine's fallback directory: the store's refused it
    tiers: tuple[str, ...] = ()
    """Where it is committed besides the store (the engine's): `memory` (the node's memory tier), `peers` (every
    replica in its peers' memories verified)."""


@dataclass
class StagedSave:
    """One save handed from the caller's thread to the writer thread."""

    step: int
    kind: str
    buf: torch.Tensor
    release: Callable[[], None]  # called once the buffer has been written (it may be reused)
    plan: StagingPlan
    skeleton: Any
    rank_state: bytes
    metadata: dict[str, Any]
    t0: float
    stage_s: float
    copies: Any  # devcopy.Copies in flight from CUDA memory into `buf`, or None
    crcs: list[int] | None  # the shard's block checksums, when staging computed them
    future: Future[SaveResult] = field(default_factory=Future)


def log_quietly(method: Callable[..., Any], event: str, **fields: Any) -> None:
    """Log from the writer thread. A broken log sink (stderr closed, or a pipe whose reader
    died, e.g. with the supervisor) must not kill the thread that resolves every save's
    future: the training loop would then hang in its next save or wait instead of going on."""
    try:
        method(event, **fields)
    except (OSError, ValueError):  # ValueError: "I/O operation on closed file"
        pass


class Committer:
    """Writes staged saves into `directory` and commits them; one instance per engine."""

    def __init__(
        self,
        directory: Path,
        comm: LocalComm | GroupComm,
        *,
        o_direct: bool,
        retention: RetentionPolicy,
        recycle: bool,
        hook: Hook,
        check_finite: bool = True,
        node: str | None = None,
        leader: bool = False,
    ):
        self.directory = directory
        self.node = node  # each node keeps its own directory (`_write_nodes`); None: one store every rank shares
        self.leader = leader if node is not None else comm.rank == 0  # the rank that commits into this directory
        self.check_finite = check_finite
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.o_direct = o_direct
        self.retention = retention
        self.recycle = recycle
        self.hook = hook

    def write(self, job: StagedSave) -> SaveResult:
        """Write, gather, commit: a collective over the engine's group (every rank, same order)."""
        if self.node is not None:
            return _write_nodes(self, job)
        step, comm = job.step, self.comm
        partial = self.directory / layout.partial_dirname(step)
        final = self.directory / layout.step_dirname(step)
        try:
            prep: dict[str, Any] | None = None
            if self.rank == 0:
                prep = self._prepare_partial(step, partial, final)
            prep = comm.broadcast(prep)
            if prep.get("skip"):
                if self.rank == 0:
                    log_quietly(
                        log.info,
                        "checkpoint_save_skipped",
                        step=step,
                        kind=job.kind,
                        path=str(final),
                        reason="this step is committed already; a checkpoint is never written over",
                    )
                return SaveResult(step, str(final), job.kind, 0, job.stage_s, 0.0, skipped=True)
            if "error" in prep:
                raise CheckpointSaveError(f"step {step}: cannot prepare {partial}: {prep['error']}")
            report = self._write_rank_files(job, partial)
        finally:
            job.release()
        reports = comm.gather(report)
        outcome: dict[str, Any] | None = None
        if self.rank == 0:
            assert reports is not None
            outcome = self._commit(job, partial, final, reports)
        outcome = comm.broadcast(outcome)
        return _committed(job, final, outcome, self.rank == 0, self.world_size, bool(prep.get("recreated")))

    def retain(self, newest: int) -> None:
        """The leader (rank 0, or each node's first local rank in a node-local store), after a commit: apply the
        retention policy to this directory, never deleting `newest`."""
        try:
            spares = self.world_size if self.recycle else 0  # one save's shard files
            apply_retention(self.directory, self.retention, protect={newest}, spares=spares)
        except (OSError, CheckpointError) as e:
            # A failed deletion must not fail a committed save; the next commit retries.
            log_quietly(log.warning, "checkpoint_retention_failed", step=newest, reason=str(e))

    def _prepare_partial(self, step: int, partial: Path, final: Path) -> dict[str, Any]:
        try:
            return self._make_partial(step, partial, final)
        finally:  # the partial directory (or the skip, or the failure) says the rest: the marker goes
            saving.clear_staging(self.directory, step)

    def _make_partial(self, step: int, partial: Path, final: Path) -> dict[str, Any]:
        try:
            dir_fd, answer = self._open_directory(step)
            if dir_fd is None:
                return answer
            try:
                existing = self._existing(step, final)
                if existing is not None:
                    return existing
                # The writer runs saves in order, so any .partial of this or an older step is torn.
                for e in os.scandir(dir_fd):
                    s = layout.parse_partial_dirname(e.name)
                    if s is not None and s <= step:
                        remove_dir(dir_fd, e.name)  # a real directory only: a planted link is left
                os.mkdir(partial.name, dir_fd=dir_fd)  # fails on anything left there: nothing is reused
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            return answer
        except OSError as e:
            return {"error": f"{e.strerror or e} ({e.filename or partial})"}
        except Exception as e:  # adapter boundary: raised here, it would leave the other ranks in the next collective
            return {"error": f"{type(e).__name__}: {e} ({partial})"}

    def _open_directory(self, step: int) -> tuple[int | None, dict[str, Any]]:
        """Rank 0 (a node's leader): the store's directory, opened, and what to tell the other ranks (`recreated`:
        it had vanished and was made again, as the engine made it at the start); (None, the error) where it cannot
        be. A directory that vanished mid-run is this save's to make again: a save that fails for it would leave
        the run without any checkpoint. mkdir(2) never goes through a link, and anything in its place is left."""
        where = self.directory
        try:
            return os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), {}
        except NotADirectoryError:
            return None, {"error": f"the checkpoint directory {where} is not a directory; move what is there away"}
        except FileNotFoundError:
            pass
        try:
            where.mkdir(parents=True)
            fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileExistsError:  # made again meanwhile (by another node's leader), or something else is there
            try:
                return os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), {}
            except OSError:
                why = "a link to nothing, or something that is not a directory, is in its place; move it away"
                return None, {"error": f"the checkpoint directory {where} vanished and {why}"}
        except OSError as e:
            why = f"({os_error_line(e)}); make its parent writable (or mount its filesystem again) so saves go on"
            return None, {"error": f"the checkpoint directory {where} vanished and cannot be made again {why}"}
        log_quietly(
            log.warning,
            "checkpoint_dir_recreated",
            step=step,
            path=str(where),
            reason="the checkpoint directory had vanished; made again for this save (checkpoints in it are gone)",
        )
        return fd, {"recreated": True}

    def _existing(self, step: int, final: Path) -> dict[str, Any] | None:
        """Rank 0: what to do when `step-N` is already there; None: nothing is (any more).

        A consistent checkpoint is never written over (saving it again is a no-op). One that is
        not consistent is quarantined (as loading would), and this save takes its place. One of a
        format this ftsup does not read, or anything but a directory, is never touched: this
        step's save fails (the caller logs it and training goes on)."""
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return {"error": f"{final} exists and is not a directory (a link or a file); remove it to save this step"}
        info = layout.inspect_checkpoint(final)
        if info.consistent:
            return {"skip": True}
        reason = "; ".join(map(str, info.problems))
        if info.unknown_format:
            return {"error": f"{final} is of a format this ftsup does not read; it is kept as it is ({reason})"}
        passed = choice.give_up(final, step, reason)
        if passed.action != choice.QUARANTINED:
            return {"error": f"{final} is not consistent and could not be quarantined: {passed.reason}"}
        log_quietly(log.warning, "checkpoint_quarantined", step=step, reason=reason, path=passed.moved_to)
        return None

    def _write_rank_files(self, job: StagedSave, partial: Path) -> dict[str, Any]:
        files: dict[str, dict[str, Any]] = {}
        try:
            if job.copies is not None:
                job.copies.landed()
            bad = first_nonfinite(job.plan, job.buf) if self.check_finite else None
            if bad is not None:
                raise CheckpointSaveError(
                    f"tensor {bad} holds a NaN or an infinity; a checkpoint is never "
                    "committed from a state that is not finite"
                )
            shard = layout.shard_name(self.rank)
            dest = partial / shard
            reuse = self.recycle and claim_spare(self.directory, dest)
            size, crcs = write_shard(str(dest), job.buf, o_direct=self.o_direct, crcs=job.crcs, reuse=reuse)
            files[shard] = {"size": size, "checksum": checksums.checksum_from_block_crcs(crcs)}
            packed = checksums.pack_block_crcs(crcs)
            crc_file = layout.crc_name(self.rank)
            layout.write_file_durable(partial / crc_file, packed)
            files[crc_file] = {"size": len(packed), "checksum": checksums.checksum_bytes(packed)}
            rank_file = layout.rank_state_name(self.rank)
            layout.write_file_durable(partial / rank_file, job.rank_state)
            files[rank_file] = {"size": len(job.rank_state), "checksum": checksums.checksum_bytes(job.rank_state)}
            self.hook("shard_written", job.step)
            return {"ok": True, "files": files, "tensor_bytes": job.plan.tensor_bytes}
        except Exception as e:  # adapter boundary: every rank must still reach the gather
            msg = f"rank {self.rank}: {type(e).__name__}: {e}"
            log_quietly(log.error, "checkpoint_write_failed", step=job.step, rank=self.rank, reason=msg)
            return {"ok": False, "error": msg}

    def _commit(self, job: StagedSave, partial: Path, final: Path, reports: list[dict[str, Any]]) -> dict[str, Any]:
        errors = [r["error"] for r in reports if not r["ok"]]
        try:
            if errors:
                raise CheckpointSaveError("; ".join(errors))
            raw = metadata_bytes(job.plan, job.skeleton)
            layout.write_file_durable(partial / layout.DCP_META_NAME, raw)
            self.hook("metadata_written", job.step)
            manifest = _manifest(job, self.world_size, reports, raw)
            layout.write_file_durable(partial / layout.MANIFEST_NAME, layout.manifest_bytes(manifest))
            layout.fsync_dir(partial)
            self.hook("manifest_written", job.step)
            os.rename(partial, final)
            layout.fsync_dir(self.directory)
            self.hook("renamed", job.step)
        except Exception as e:  # adapter boundary: report to every rank, leave no torn dir
            shutil.rmtree(partial, ignore_errors=True)
            return {"ok": False, "error": str(e)}
        return {"ok": True}


# --------------------------------------------------------------------------- node-local stores
# The commit of a save where each node keeps its own checkpoint directory (`checkpoint.dir_shared: false`): the same
# protocol, once per node (ftsup/store/DESIGN.md, Node-local fast tiers).


def _write_nodes(c: Committer, job: StagedSave) -> SaveResult:
    """`Committer.write` of a node-local store: a collective over the engine's group (every rank, same order)."""
    step, comm = job.step, c.comm
    partial = c.directory / layout.partial_dirname(step)
    final = c.directory / layout.step_dirname(step)
    try:
        prep = c._prepare_partial(step, partial, final) if c.leader else None
        preps = comm.gather(prep)
        plan = _combine(preps) if c.rank == 0 and preps is not None else None
        plan = comm.broadcast(plan)
        if plan.get("skip"):
            if c.rank == 0:
                why = "this step is committed already on every node; a checkpoint is never written over"
                log_quietly(log.info, "checkpoint_save_skipped", step=step, kind=job.kind, path=str(final), reason=why)
            return SaveResult(step, str(final), job.kind, 0, job.stage_s, 0.0, skipped=True)
        if "error" in plan:
            if prep == {}:  # this leader made its partial directory: nothing is written into it
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointSaveError(f"step {step}: cannot prepare the partial directories: {plan['error']}")
        report = c._write_rank_files(job, partial)
    finally:
        job.release()
    report["node"] = c.node
    reports = comm.gather(report)
    staged = _build(c, job, reports) if c.rank == 0 and reports is not None else None
    staged = comm.broadcast(staged)
    mine: dict[str, Any] = {"ok": True}
    if c.leader:
        mine = _stage(c, job, partial, staged) if staged["ok"] else {"ok": False, "error": staged["error"]}
    staged_all = comm.gather(mine)
    go = comm.broadcast(_all_ok(staged_all) if c.rank == 0 else None)
    done: dict[str, Any] = {"ok": True}
    if c.leader:
        done = _rename(c, step, partial, final) if go["ok"] else _drop(partial)
    outcome = go
    if go["ok"]:
        renamed = comm.gather(done)
        outcome = comm.broadcast(_all_ok(renamed) if c.rank == 0 else None)
    recreated, nodes = bool(plan.get("recreated")), len(staged.get("nodes", ()))
    return _committed(job, final, outcome, c.rank == 0, c.world_size, recreated, nodes=nodes)


def _committed(
    job: StagedSave, final: Path, outcome: dict[str, Any], logs: bool, world_size: int, recreated: bool, **more: Any
) -> SaveResult:
    """A save's end on every rank once the group agreed on `outcome`: its error raised, else its result (and, on the
    rank that `logs`, `checkpoint_committed` with the `more` fields)."""
    step = job.step
    if not outcome["ok"]:
        raise CheckpointSaveError(f"step {step}: {outcome['error']}; the previous checkpoint is intact")
    durable_s = time.perf_counter() - job.t0
    if logs:
        fields = {"kind": job.kind, "world_size": world_size, "duration_s": round(durable_s, 4), "path": str(final)}
        log_quietly(log.info, "checkpoint_committed", step=step, **fields, **more)
    return SaveResult(step, str(final), job.kind, job.plan.tensor_bytes, job.stage_s, durable_s, recreated=recreated)


def _combine(preps: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Rank 0: the leaders' preparations as one answer: skip (every node holds the step), an error, or go."""
    mine = [p for p in preps if p is not None]
    errors = [p["error"] for p in mine if "error" in p]
    if errors:
        return {"error": "; ".join(errors)}
    skips = [bool(p.get("skip")) for p in mine]
    if all(skips):
        return {"skip": True}
    if any(skips):
        return {"error": "this step is committed on some nodes and not on others; it is not saved again"}
    return {"recreated": True} if any(p.get("recreated") for p in mine) else {}


def _manifest(
    job: StagedSave,
    world_size: int,
    reports: list[dict[str, Any]],
    dcp: bytes,
    nodes: dict[str, tuple[int, ...]] | None = None,
) -> layout.Manifest:
    """The manifest of `job`: every rank's files (as `reports` say), the DCP metadata `dcp` and, on a store each node
    writes its own part of, which node holds which ranks (`nodes`)."""
    files: dict[str, layout.FileEntry] = {}
    for r in reports:
        files.update({k: layout.FileEntry(v["size"], v["checksum"]) for k, v in r["files"].items()})
    files[layout.DCP_META_NAME] = layout.FileEntry(len(dcp), checksums.checksum_bytes(dcp))
    return layout.Manifest(
        step=job.step,
        world_size=world_size,
        kind=job.kind,
        created_unix=time.time(),
        files=files,
        tensor_bytes=sum(r["tensor_bytes"] for r in reports),
        metadata=job.metadata,
        nodes=nodes,
    )


def _build(c: Committer, job: StagedSave, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: the manifest (recording which node holds which ranks) and `dcp_metadata.json`, as bytes."""
    errors = [r["error"] for r in reports if not r["ok"]]
    if errors:
        return {"ok": False, "error": "; ".join(errors)}
    try:
        by_node: dict[str, list[int]] = {}
        for rank, r in enumerate(reports):
            by_node.setdefault(str(r["node"]), []).append(rank)
        dcp = metadata_bytes(job.plan, job.skeleton)
        nodes = {n: tuple(ranks) for n, ranks in sorted(by_node.items())}
        manifest = _manifest(job, c.world_size, reports, dcp, nodes)
        raw = layout.manifest_bytes(manifest)
        layout.parse_manifest(raw, f"the manifest of step {job.step}")  # node ids included: refused before any write
    except Exception as e:  # adapter boundary: reported to every rank
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "manifest": raw, "dcp": dcp, "nodes": sorted(by_node)}


def _stage(c: Committer, job: StagedSave, partial: Path, staged: dict[str, Any]) -> dict[str, Any]:
    """A leader: `dcp_metadata.json`, the node file and the manifest into its partial directory, fsynced."""
    try:
        layout.write_file_durable(partial / layout.DCP_META_NAME, staged["dcp"])
        c.hook("metadata_written", job.step)
        layout.write_file_durable(partial / nodes.NODE_FILE, nodes.node_file_bytes(str(c.node)))
        layout.write_file_durable(partial / layout.MANIFEST_NAME, staged["manifest"])
        layout.fsync_dir(partial)
        c.hook("manifest_written", job.step)
    except Exception as e:  # adapter boundary: reported to every rank
        return {"ok": False, "error": f"node {c.node}: {type(e).__name__}: {e}"}
    return {"ok": True}


def _rename(c: Committer, step: int, partial: Path, final: Path) -> dict[str, Any]:
    try:
        os.rename(partial, final)
        layout.fsync_dir(c.directory)
        c.hook("renamed", step)
    except Exception as e:  # adapter boundary: reported to every rank
        shutil.rmtree(partial, ignore_errors=True)
        return {"ok": False, "error": f"node {c.node}: not committed there ({type(e).__name__}: {e})"}
    return {"ok": True}


def _drop(partial: Path) -> dict[str, Any]:
    shutil.rmtree(partial, ignore_errors=True)
    return {"ok": True}


def _all_ok(results: list[dict[str, Any]] | None) -> dict[str, Any]:
    errors = [r["error"] for r in results or [] if r is not None and not r.get("ok", True)]
    return {"ok": not errors, "error": "; ".join(errors)}
