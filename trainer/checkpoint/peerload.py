"""A load where the nodes keep their parts in memory: what every node holds (its own part in memory or on disk, its
peers' parts), the newest step whose every part some node holds, and each node's whole copy of it made in its
memory, the parts it lacks received from the nodes holding them and verified (trainer/checkpoint/DESIGN.md,
Recovery from peers).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ftsup import memtier
from ftsup.store import layout, nodes, safefile
from ftsup.store.errors import CheckpointError
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.commit import Committer
from ftsup.trainer.checkpoint.peermsg import PeerError, check_offer, offer, rank_files, reason_of
from ftsup.trainer.checkpoint.peers import (
    MEMORY,
    PEERS,
    PEERS_DIRNAME,
    Ring,
    Transfer,
    exchange,
    own_dir,
    reader,
    write_part,
)

log = structlog.get_logger("ftsup.checkpoint")

RESTORE_DIRNAME = memtier.RESTORE_DIRNAME
DISK = "disk"
_PREFERENCE = {MEMORY: 0, PEERS: 1, DISK: 2}  # a part from memory first, then a peer's memory, then a disk


@dataclass(frozen=True)
class Restored:
    """The whole copy of checkpoint `step` this rank's node made in its memory, and where its parts came from:
    `memory` (its own), `peers` (any part from another node or a replica)."""

    path: Path
    step: int
    tier: str


def holdings(memory: Path, disk: Path | None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """A leader: each committed copy of a node's part it holds that passes the fast check ({step, part, tier, path,
    digest}), and each manifest's text by its digest."""
    held: list[dict[str, Any]] = []
    texts: dict[str, str] = {}
    roots: list[tuple[Path, str]] = [(memory, MEMORY)] + ([(disk, DISK)] if disk is not None else [])
    try:
        for e in os.scandir(memory / PEERS_DIRNAME):
            if nodes.is_node_id(e.name) and e.is_dir(follow_symlinks=False):
                roots.append((Path(e.path), PEERS))
    except OSError:
        pass  # none held
    for root, tier in roots:
        # Copies in memory are read whole (at memory speed): one with a flipped byte is never offered, and the part
        # comes from another copy. A disk's copy gets the fast check; the load verifies every block it reads.
        for info in layout.list_checkpoints(root, deep=tier != DISK):
            if not info.consistent:
                reason = "; ".join(map(str, info.problems))
                log.warning("checkpoint_peer_copy_skipped", step=info.step, tier=tier, path=info.path, reason=reason)
                continue
            try:
                path = Path(info.path)
                manifest = layout.read_manifest(path)
                raw = safefile.read_regular(path / layout.MANIFEST_NAME, info.path, layout.MANIFEST_MAX_BYTES)
                where = str(path / nodes.NODE_FILE)
                part_raw = safefile.read_regular(where, where, nodes.NODE_FILE_MAX_BYTES)
                part = nodes.parse_node_file(part_raw, manifest.nodes, where)
            except (CheckpointError, OSError):
                continue  # not a node's part (a copy of a one-node job), or it changed: not offered
            digest = hashlib.sha256(raw).hexdigest()
            texts[digest] = raw.decode()
            held.append({"step": info.step, "part": part, "tier": tier, "path": info.path, "digest": digest})
    return held, texts


def choose(reports: list[Mapping[str, Any]], store_step: int | None) -> dict[str, Any] | None:
    """Rank 0: the newest step (at most every rank's bound) whose every part some live node holds, and how each
    node gets each part (`links`: from a copy of its own; `moves`: from another node); None when there is none, or
    the shared store holds a newer one (`store_step`)."""
    bounds = [r["at_most"] for r in reports if r.get("at_most") is not None]
    bound = min(bounds) if bounds else None
    leaders = {r["node"]: rank for rank, r in enumerate(reports) if r.get("leader")}
    texts: dict[str, str] = {}
    held: list[tuple[int, dict[str, Any]]] = []
    for rank, r in enumerate(reports):
        if r.get("leader"):
            texts.update(r["texts"])
            held += [(rank, h) for h in r["held"]]
    steps = sorted({h["step"] for _, h in held if bound is None or h["step"] <= bound}, reverse=True)
    for step in steps:
        if store_step is not None and store_step > step:
            return None
        complete = []  # the step's saves (the store's and the memory tier's manifests differ) whose parts are all held
        for digest in sorted({h["digest"] for _, h in held if h["step"] == step}):
            try:
                manifest = layout.parse_manifest(texts[digest], f"a peer's manifest of step {step}")
            except CheckpointError:
                continue
            if manifest.step != step or manifest.nodes is None:
                continue
            copies = sorted(
                ((rank, h) for rank, h in held if h["digest"] == digest), key=lambda c: _PREFERENCE[c[1]["tier"]]
            )
            best = {h["part"]: _PREFERENCE[h["tier"]] for _, h in reversed(copies)}
            if set(manifest.nodes) <= set(best):
                complete.append((sum(best.values()), digest, manifest, copies))
        if complete:  # the one read most from memory
            _, digest, manifest, copies = min(complete, key=lambda c: (c[0], c[1]))
            return _plan(step, digest, texts[digest], manifest, copies, leaders)
    return None


def _plan(
    step: int,
    digest: str,
    text: str,
    manifest: layout.Manifest,
    copies: list[tuple[int, dict[str, Any]]],
    leaders: Mapping[str, int],
) -> dict[str, Any]:
    assert manifest.nodes is not None
    links: dict[int, list[list[str]]] = {}
    moves: list[dict[str, Any]] = []
    load: dict[int, int] = {}
    for lr in leaders.values():
        mine: dict[str, dict[str, Any]] = {}
        for rank, h in copies:  # the preferred copy of each part first
            if rank == lr:
                mine.setdefault(h["part"], h)
        links[lr] = [[p, mine[p]["path"], mine[p]["tier"]] for p in sorted(manifest.nodes) if p in mine]
        common = not links[lr]  # the files of every node come with the first part received
        for part in sorted(set(manifest.nodes) - set(mine)):
            holders = [(rank, h) for rank, h in copies if h["part"] == part]
            rank, h = min(holders, key=lambda c: (_PREFERENCE[c[1]["tier"]], load.get(c[0], 0)))
            load[rank] = load.get(rank, 0) + 1
            moves.append({"from": rank, "path": h["path"], "to": lr, "part": part, "common": common})
            common = False
    plan = {"step": step, "digest": digest, "manifest": text, "links": links, "moves": moves}
    return plan | {"leaders": dict(leaders)}


def before_load(
    comm: LocalComm | GroupComm, memory: Committer, ring: Ring, directory: Path, at_most: int | None, node_local: bool
) -> Restored | None:
    """The engine's load, every rank alike: each node's whole copy of the newest checkpoint the nodes hold together
    (`restore`), unless the shared store `directory` holds a newer one; `node_local`: `directory` is the node's own,
    whose part is offered too."""
    if not isinstance(comm, GroupComm):
        return None
    store_step = None
    if comm.rank == 0 and not node_local:
        newest = layout.latest_consistent(directory, below=None if at_most is None else at_most + 1)
        store_step = newest.step if newest is not None else None
    disk = directory if node_local else None
    return restore(comm, memory.directory, disk, ring.node, memory.leader, at_most, store_step)


def restore(
    comm: GroupComm,
    memory: Path,
    disk: Path | None,
    node: str,
    leader: bool,
    at_most: int | None,
    store_step: int | None,
) -> Restored | None:
    """Every rank alike: each node's whole copy of the newest checkpoint its nodes' memories and disks can make
    together, in `memory/restore/step-N/`; None (logged) when there is none or making it failed anywhere."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"node": node, "leader": leader, "at_most": at_most}
    if leader:
        report["held"], report["texts"] = holdings(memory, disk)
    reports = comm.gather(report)
    plan = choose(reports, store_step) if comm.rank == 0 and reports is not None else None
    plan = comm.broadcast(plan)
    if plan is None:
        return None
    step = plan["step"]
    manifest = layout.parse_manifest(plan["manifest"], f"the chosen manifest of step {step}")
    if hashlib.sha256(plan["manifest"].encode()).hexdigest() != plan["digest"]:
        raise PeerError(f"step {step}: the chosen manifest is not the one its digest names")
    assert manifest.nodes is not None
    final = memory / RESTORE_DIRNAME / layout.step_dirname(step)
    partial = final.with_name(layout.partial_dirname(step))
    common = [rel for rel in manifest.files if nodes.rank_of(rel) is None]
    sends, recvs = [], []
    for m in plan["moves"]:
        part_files = rank_files(manifest, manifest.nodes[m["part"]]) + (common if m["common"] else [])
        if m["from"] == comm.rank:
            source = Path(m["path"])
            header = offer(step, m["part"], part_files, manifest)
            sends.append(Transfer(m["to"], m["part"], header, part_files, reader(source, manifest), manifest=manifest))
        if m["to"] == comm.rank:
            check = _checker(manifest, step, m["part"], part_files)
            recvs.append(Transfer(m["from"], m["part"], check=check, manifest=manifest))
    failed: str | None = None
    try:
        if leader:
            shutil.rmtree(memory / RESTORE_DIRNAME, ignore_errors=True)  # never through a link: rmtree refuses one
            own_dir(memory / RESTORE_DIRNAME)
        exchange(comm, sends, recvs)
        failed = next((t.error for t in sends + recvs if t.error), None)
        if failed is None and leader:
            _assemble(partial, manifest, plan["links"].get(comm.rank, []), recvs, plan["manifest"].encode(), common)
            os.rename(partial, final)
    except Exception as e:  # adapter boundary (gloo's errors are RuntimeErrors): every rank must reach the vote
        failed = reason_of(e)
    if comm.all_reduce_max(1 if failed else 0):
        log.warning("checkpoint_peer_restore_failed", step=step, rank=comm.rank, reason=failed or "another rank failed")
        if leader:
            shutil.rmtree(memory / RESTORE_DIRNAME, ignore_errors=True)
        return None
    tier = _tier_of(plan, plan["leaders"][node])
    if leader:
        parts = {p: f"{t} {path}" for p, path, t in plan["links"].get(comm.rank, [])}
        parts |= {m["part"]: f"{PEERS} from group rank {m['from']}" for m in plan["moves"] if m["to"] == comm.rank}
        took = round(time.perf_counter() - t0, 4)
        log.info(
            "checkpoint_peer_restored", step=step, rank=comm.rank, node=node, tier=tier, parts=parts, duration_s=took
        )
    return Restored(final, step, tier)


def _tier_of(plan: Mapping[str, Any], leader: int) -> str:
    """A node's tier for the load: `memory` when every part it reads was in its own memory, `peers` else."""
    received = any(m["to"] == leader for m in plan["moves"])
    return PEERS if received or any(t != MEMORY for _, _, t in plan["links"].get(leader, [])) else MEMORY


def _checker(manifest: layout.Manifest, step: int, part: str, expected: list[str]) -> Any:
    return lambda raw: check_offer(raw, manifest, step, part, expected)


def _assemble(
    partial: Path,
    manifest: layout.Manifest,
    links: list[list[str]],
    recvs: list[Transfer],
    raw: bytes,
    common: list[str],
) -> None:
    """The leader: the whole copy in `partial`: the parts received, and those of its own copies (linked in memory,
    copied from a disk), the files of every node from its first own copy, the manifest."""
    assert manifest.nodes is not None
    got: dict[str, bytes | memoryview] = {layout.MANIFEST_NAME: raw}
    for r in recvs:
        got |= r.got
    write_part(partial, got)
    for i, (part, path, _) in enumerate(links):
        rels = rank_files(manifest, manifest.nodes[part]) + (common if i == 0 else [])
        for rel in rels:
            src = safefile.resolve_inside(path, rel)
            try:
                os.link(src, partial / rel, follow_symlinks=False)
            except OSError:  # another filesystem (a disk's copy)
                shutil.copyfile(src, partial / rel, follow_symlinks=False)
