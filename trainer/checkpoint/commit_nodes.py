"""The commit of a save where each node keeps its own checkpoint directory (`checkpoint.dir_shared: false`).

The same protocol as a shared store (`commit`, DESIGN.md "The commit protocol"), once per node: every node's first
local rank (its leader) prepares `step-N.partial/` in its own node's directory; every rank writes its files there;
rank 0 gathers every file's size and checksum and builds the one manifest, which also records which node holds which
ranks' files (`ftsup.store.nodes`); every leader writes `dcp_metadata.json`, its `node.json` and that manifest's
exact bytes into its partial directory and fsyncs it; once every leader has, each renames its own to `step-N/`.
So every node's supervisor sees the step committed in its own store, with the files of its node, and the manifest
bytes (whose hash names the checkpoint's data in the durable tier) are the same on every node. A failure before the
renames is reported to every rank and every partial directory is removed: the previous checkpoint stays the latest
consistent one on every node. A rename that fails on one node after others' (a disk gone) fails the save, naming
the node; the copies renamed elsewhere stay (never committed in the durable tier without that node's part).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftsup.store import checksums, layout, nodes
from ftsup.store.errors import CheckpointSaveError
from ftsup.trainer.checkpoint.staging import metadata_bytes

if TYPE_CHECKING:
    from ftsup.trainer.checkpoint.commit import Committer, SaveResult, StagedSave


def write(c: Committer, job: StagedSave) -> SaveResult:
    """`Committer.write` of a node-local store: a collective over the engine's group (every rank, same order)."""
    from ftsup.trainer.checkpoint.commit import SaveResult, log, log_quietly

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
    if not outcome["ok"]:
        raise CheckpointSaveError(f"step {step}: {outcome['error']}; the previous checkpoint is intact")
    durable_s = time.perf_counter() - job.t0
    if c.rank == 0:
        log_quietly(log.info, "checkpoint_committed", step=step, kind=job.kind, world_size=c.world_size,
                    duration_s=round(durable_s, 4), path=str(final), nodes=len(staged.get("nodes", ())))  # fmt: skip
    return SaveResult(step, str(final), job.kind, job.plan.tensor_bytes, job.stage_s, durable_s)


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
    return {}


def _build(c: Committer, job: StagedSave, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: the manifest (recording which node holds which ranks) and `dcp_metadata.json`, as bytes."""
    errors = [r["error"] for r in reports if not r["ok"]]
    if errors:
        return {"ok": False, "error": "; ".join(errors)}
    try:
        files: dict[str, layout.FileEntry] = {}
        by_node: dict[str, list[int]] = {}
        for rank, r in enumerate(reports):
            files.update({k: layout.FileEntry(v["size"], v["checksum"]) for k, v in r["files"].items()})
            by_node.setdefault(str(r["node"]), []).append(rank)
        dcp = metadata_bytes(job.plan, job.skeleton)
        files[layout.DCP_META_NAME] = layout.FileEntry(len(dcp), checksums.checksum_bytes(dcp))
        manifest = layout.Manifest(
            step=job.step, world_size=c.world_size, kind=job.kind, created_unix=time.time(), files=files,
            tensor_bytes=sum(r["tensor_bytes"] for r in reports), metadata=job.metadata,
            nodes={n: tuple(ranks) for n, ranks in sorted(by_node.items())},
        )  # fmt: skip
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
