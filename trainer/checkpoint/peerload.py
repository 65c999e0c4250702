"""A load where the nodes keep their parts in memory: what every node holds (its own part in memory or on disk, its
peers' parts), the newest step whose every part some node holds, and each node's copy of the files its ranks' loads
read made in its memory, those it lacks received from the nodes holding them and verified (trainer/checkpoint/
DESIGN.md, Recovery from peers).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from ftsup import memtier
from ftsup.store import checksums, dcpmeta, layout, nodes, safefile
from ftsup.store.errors import CheckpointError
from ftsup.trainer.checkpoint import loadplan
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.commit import Committer
from ftsup.trainer.checkpoint.peermsg import PeerError, check_offer, offer, rank_files, reason_of
from ftsup.trainer.checkpoint.peers import (
    MEMORY,
    PEERS,
    PEERS_DIRNAME,
    Transfer,
    exchange,
    own_dir,
    reader,
    write_part,
)
from ftsup.trainer.checkpoint.reader import ShardReader
from ftsup.trainer.checkpoint.shardio import VerifiedFile, read_files

log = structlog.get_logger("ftsup.checkpoint")

RESTORE_DIRNAME = memtier.RESTORE_DIRNAME
DISK = "disk"
_PREFERENCE = {MEMORY: 0, PEERS: 1, DISK: 2}  # a part from memory first, then a peer's memory, then a disk
_MAX_TRIES = 8  # plans made again, each without the copies the last one found damaged


@dataclass(frozen=True)
class Restored:
    """The copy of checkpoint `step` this rank's node made in its memory, and where its parts came from: `memory`
    (its own), `peers` (any part from another node or a replica). `held`: the files of the manifest it holds (those
    its node's ranks' loads read; None: every one); `meta`: its DCP metadata, verified and packed (`loadplan.pack`);
    `kept`: the regions (start, bytes) of the shard files no other rank of the node reads, as received or read from
    a copy in memory and verified then, instead of in the copy, for this rank's load to read from."""

    path: Path
    step: int
    tier: str
    held: frozenset[str] | None = None
    meta: Mapping[str, Any] | None = None
    kept: Mapping[str, list[tuple[int, torch.Tensor]]] | None = None


def holdings(memory: Path, disk: Path | None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """A leader: each committed copy of a node's part it holds that passes the fast check ({step, part, tier, path,
    digest}), and each manifest's text by its digest. Checksums are left to the files the plan links or sends."""
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
        # The fast check only: a file of a copy in memory is verified where the plan links it (`_verify_links`) or
        # sends it (on arrival), and a copy with a damaged one is planned around (`restore`). A disk's copy: the load
        # verifies every block it reads.
        for info in layout.list_checkpoints(root, deep=False):
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


def choose(
    reports: list[Mapping[str, Any]], store_step: int | None, skip: Collection[tuple[int, str]] = ()
) -> dict[str, Any] | None:
    """Rank 0: the newest step (at most every rank's bound) whose every part some live node holds, how each node gets
    each part (`links`: from a copy of its own; `moves`: from another node) and who reads its metadata (`meta`: the
    holder of its preferred copy, and where); None when there is none, or the shared store holds a newer one
    (`store_step`). `skip`: the copies (group rank, path) found damaged, never chosen. Which files of each part move
    is `narrow`'s."""
    bounds = [r["at_most"] for r in reports if r.get("at_most") is not None]
    bound = min(bounds) if bounds else None
    leaders = {r["node"]: rank for rank, r in enumerate(reports) if r.get("leader")}
    texts: dict[str, str] = {}
    held: list[tuple[int, dict[str, Any]]] = []
    for rank, r in enumerate(reports):
        if r.get("leader"):
            texts.update(r["texts"])
            held += [(rank, h) for h in r["held"] if (rank, h["path"]) not in skip]
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
        for part in sorted(set(manifest.nodes) - set(mine)):
            holders = [(rank, h) for rank, h in copies if h["part"] == part]
            rank, h = min(holders, key=lambda c: (_PREFERENCE[c[1]["tier"]], load.get(c[0], 0)))
            load[rank] = load.get(rank, 0) + 1
            moves.append({"from": rank, "path": h["path"], "tier": h["tier"], "to": lr, "part": part})
    plan = {"step": step, "digest": digest, "manifest": text, "links": links, "moves": moves}
    return plan | {"leaders": dict(leaders), "meta": [copies[0][0], copies[0][1]["path"]]}


def narrow(plan: Mapping[str, Any], manifest: layout.Manifest, needs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Rank 0: `plan` with each node's links and moves narrowed to the files its ranks' loads read (`needs`: each
    rank's {node, files}; files None: every file), each named (`files`); the files of every node come once to each
    node's copy, with its first link or else its first move; a move left with no file is dropped. `alone`: for
    each leader, the files it reads that no other rank of its node reads."""
    assert manifest.nodes is not None
    want: dict[str, set[str] | None] = {}
    for n in needs:
        got = want.get(n["node"], set())
        want[n["node"]] = None if got is None or n["files"] is None else got | set(n["files"])
    common = [rel for rel in sorted(manifest.files) if nodes.rank_of(rel) is None]
    links: dict[int, list[list[Any]]] = {}
    moves: list[dict[str, Any]] = []
    alone: dict[int, list[str]] = {}
    for node, lr in sorted(plan["leaders"].items()):
        w = want.get(node)
        others = [n["files"] for r, n in enumerate(needs) if n["node"] == node and r != lr]
        if lr < len(needs) and needs[lr]["files"] is not None and None not in others:
            alone[lr] = sorted(set(needs[lr]["files"]).difference(*others))
        own = [
            [part, path, tier, [r for r in rank_files(manifest, manifest.nodes[part]) if w is None or r in w]]
            for part, path, tier in plan["links"].get(lr, [])
        ]
        mine = [
            dict(m, files=[r for r in rank_files(manifest, manifest.nodes[m["part"]]) if w is None or r in w])
            for m in plan["moves"]
            if m["to"] == lr
        ]
        first = own[0][3] if own else next((m["files"] for m in mine if m["files"]), mine[0]["files"] if mine else None)
        if first is not None:
            first += common
        links[lr] = [entry for entry in own if entry[3]]
        moves += [m for m in mine if m["files"]]
    return dict(plan, links=links, moves=moves, alone=alone)


def before_load(
    comm: LocalComm | GroupComm,
    memory: Committer,
    node: str,
    directory: Path,
    at_most: int | None,
    node_local: bool,
    flat: Mapping[str, torch.Tensor] | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> Restored | None:
    """The engine's load, every rank alike: each node's copy of the newest checkpoint the nodes hold together
    (`restore`), unless the shared store `directory` holds a newer one; `node`: this rank's node; `node_local`:
    `directory` is the node's own, whose part is offered too; `flat`: the state the load reads into
    (`codec.flatten`), whose plan says which files each node's copy needs (None: every file); `pool`: the engine's
    reading threads (`shardio.reading_pool`)."""
    store_step = None
    if comm.rank == 0 and not node_local:
        newest = layout.latest_consistent(directory, below=None if at_most is None else at_most + 1)
        store_step = newest.step if newest is not None else None
    disk = directory if node_local else None
    return restore(comm, memory.directory, disk, node, memory.leader, at_most, store_step, flat, pool)


def holds_peers(memory: Path) -> bool:
    """Whether this node's memory holds other nodes' parts: it was one node of several, whose replicas it kept."""
    try:
        return any(nodes.is_node_id(e.name) for e in os.scandir(memory / PEERS_DIRNAME))
    except OSError:
        return False


def restore(
    comm: LocalComm | GroupComm,
    memory: Path,
    disk: Path | None,
    node: str,
    leader: bool,
    at_most: int | None,
    store_step: int | None,
    flat: Mapping[str, torch.Tensor] | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> Restored | None:
    """Every rank alike: each node's copy of the newest checkpoint its nodes' memories and disks can make together,
    of the files its ranks' loads of `flat` read (every file without it), in `memory/restore/step-N.subset/`; None
    (logged) when there is none or making it failed anywhere. A copy a file of which failed its checksum where it was
    linked or received is planned around: the plan is made again without it (logged)."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"node": node, "leader": leader, "at_most": at_most}
    if leader:
        report["held"], report["texts"] = holdings(memory, disk)
    reports = comm.gather(report)
    skip: list[tuple[int, str]] = []
    for _ in range(_MAX_TRIES):
        plan = choose(reports, store_step, skip) if comm.rank == 0 and reports is not None else None
        plan = comm.broadcast(plan)
        if plan is None:
            return None
        restored, damaged = _attempt(comm, plan, memory, node, leader, flat, t0, pool)
        if not damaged:
            return restored
        skip += [(rank, path) for rank, path in damaged]
    log.warning("checkpoint_peer_restore_failed", rank=comm.rank, reason=f"{_MAX_TRIES} plans met damaged copies")
    return None


def _attempt(
    comm: LocalComm | GroupComm,
    plan: dict[str, Any],
    memory: Path,
    node: str,
    leader: bool,
    flat: Mapping[str, torch.Tensor] | None,
    t0: float,
    pool: ThreadPoolExecutor | None = None,
) -> tuple[Restored | None, list[list[Any]]]:
    """Every rank alike: `plan` carried out; (the copy, []), (None, []) where it failed, or (None, the copies
    [group rank, path] a file of which failed its checksum where it was linked or received, on any rank)."""
    step = plan["step"]
    manifest = layout.parse_manifest(plan["manifest"], f"the chosen manifest of step {step}")
    if hashlib.sha256(plan["manifest"].encode()).hexdigest() != plan["digest"]:
        raise PeerError(f"step {step}: the chosen manifest is not the one its digest names")
    assert manifest.nodes is not None
    meta = _meta(comm, plan, manifest)
    ranges = _reads(comm, manifest, meta, flat)
    needs = comm.gather({"node": node, "files": None if ranges is None else sorted(ranges)})
    plan = comm.broadcast(narrow(plan, manifest, needs) if comm.rank == 0 and needs is not None else None)
    final = memory / RESTORE_DIRNAME / layout.subset_dirname(step)
    partial = memory / RESTORE_DIRNAME / layout.partial_dirname(step)
    sends, recvs = [], []
    for m in plan["moves"]:
        if m["from"] == comm.rank:
            source = Path(m["path"])
            header = offer(step, m["part"], m["files"], manifest)
            sends.append(Transfer(m["to"], m["part"], header, m["files"], reader(source, manifest), manifest=manifest))
        if m["to"] == comm.rank:
            check = _checker(manifest, step, m["part"], m["files"])
            recvs.append((m, Transfer(m["from"], m["part"], check=check, manifest=manifest)))
    held = _held(plan, plan["leaders"][node])
    kept: dict[str, list[tuple[int, torch.Tensor]]] = {}
    failed: str | None = None
    damaged: list[list[Any]] = []
    try:
        if leader:
            shutil.rmtree(memory / RESTORE_DIRNAME, ignore_errors=True)  # never through a link: rmtree refuses one
            own_dir(memory / RESTORE_DIRNAME)
        links = plan["links"].get(comm.rank, []) if leader else []
        alone = {rel: ranges[rel] for rel in plan.get("alone", {}).get(comm.rank, ()) if ranges and rel in ranges}
        # The files linked are read and checked while the exchange runs: the exchange waits on the network.
        with ThreadPoolExecutor(1, thread_name_prefix="ftsup-ckpt-links") as beside:
            linked = beside.submit(_verify_links, step, links, manifest, alone, pool) if links else None
            if plan["moves"]:  # every rank alike: where each node holds what it needs, nothing crosses
                assert isinstance(comm, GroupComm)
                exchange(comm, sends, [r for _, r in recvs])
            bad, kept = linked.result() if linked is not None else ([], {})
        # A send's error is its receiver's too (an offer refused, or zeros that fail the checksum there).
        for m, r in recvs:
            if r.error:
                _skipped(step, m["tier"], m["path"], f"from group rank {m['from']}: {r.error}")
                damaged.append([m["from"], m["path"]])
        damaged += [[comm.rank, path] for path in bad]
        if not damaged and leader:
            kept |= _kept([r for _, r in recvs], alone, manifest)
            _assemble(partial, links, [r for _, r in recvs], plan["manifest"].encode(), held, kept)
            os.rename(partial, final)
    except Exception as e:  # adapter boundary (gloo's errors are RuntimeErrors): every rank must reach the vote
        failed = reason_of(e)
    verdict = comm.all_reduce_max(2 if failed else 1 if damaged else 0)
    if verdict:
        if leader:
            shutil.rmtree(memory / RESTORE_DIRNAME, ignore_errors=True)
        if verdict == 1:  # every copy found damaged anywhere, for the next plan
            found = comm.gather(damaged)
            return None, comm.broadcast(None if found is None else [d for ds in found for d in ds])
        log.warning("checkpoint_peer_restore_failed", step=step, rank=comm.rank, reason=failed or "another rank failed")
        return None, []
    tier = _tier_of(plan, plan["leaders"][node])
    if leader:
        parts = {p: f"{t} {path}" for p, path, t, _ in plan["links"].get(comm.rank, [])}
        parts |= {m["part"]: f"{PEERS} from group rank {m['from']}" for m in plan["moves"] if m["to"] == comm.rank}
        log.info(
            "checkpoint_peer_restored",
            step=step,
            rank=comm.rank,
            node=node,
            tier=tier,
            parts=parts,
            kept_bytes=sum(region.numel() for regions in kept.values() for _, region in regions),
            received_bytes=sum(
                manifest.files[rel].size for m in plan["moves"] if m["to"] == comm.rank for rel in m["files"]
            ),
            held_bytes=sum(manifest.files[rel].size for rel in held),
            checkpoint_bytes=sum(e.size for e in manifest.files.values()),
            duration_s=round(time.perf_counter() - t0, 4),
        )
    return Restored(final, step, tier, frozenset(held), None if "error" in meta else meta, kept), []


def _verify_links(
    step: int,
    links: list[list[Any]],
    manifest: layout.Manifest,
    alone: Mapping[str, list[tuple[int, int]]] | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> tuple[list[str], dict[str, list[tuple[int, torch.Tensor]]]]:
    """A leader: the paths of its copies in memory (its own, a replica) a file of which, among those it links, is
    not of the manifest's checksum (logged; a disk's copy is left to the load, which verifies every block it reads);
    and of the shard files among them only the leader reads (`alone`, with the ranges its load reads), those ranges
    read and verified block by block for its load to read from (`Restored.kept`): one pass over what the load reads,
    where a check of each whole file and then the load's read made two."""
    alone = alone or {}
    bad: list[str] = []
    kept: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for _, path, tier, rels in links:
        if tier == DISK:
            continue
        whole = {rel: crc for rel in rels if rel in alone and (crc := _sidecar_of(rel, manifest)) is not None}
        problem: str | None = None
        try:
            files = [(VerifiedFile.in_checkpoint(path, manifest, rel, crc), rel) for rel, crc in whole.items()]
            got = read_files([(vf, alone[rel]) for vf, rel in files], pool=pool) if files else []
            for (_, rel), regions in zip(files, got, strict=True):
                kept[rel] = regions
            for rel in (r for r in rels if r not in whole):
                actual = checksums.file_checksum(safefile.resolve_inside(path, rel), manifest.checksum_algorithm)
                if actual != manifest.files[rel].checksum:
                    problem = f"{rel}: checksum {actual} != recorded"
                    break
        except (CheckpointError, OSError) as e:
            problem = reason_of(e)
        if problem is not None:
            _skipped(step, tier, path, problem)
            bad.append(path)
            for rel in whole:
                kept.pop(rel, None)
    return bad, kept


def _sidecar_of(rel: str, manifest: layout.Manifest) -> str | None:
    """The block checksums' file of shard file `rel`; None for a file that is not a rank's shard."""
    k = nodes.rank_of(rel)
    if k is None or rel != layout.shard_name(k) or layout.crc_name(k) not in manifest.files:
        return None
    return layout.crc_name(k)


def _skipped(step: int, tier: str, path: str, reason: str) -> None:
    log.warning("checkpoint_peer_copy_skipped", step=step, tier=tier, path=path, reason=reason)


def _meta(comm: LocalComm | GroupComm, plan: Mapping[str, Any], manifest: layout.Manifest) -> dict[str, Any]:
    """Every rank alike: the chosen checkpoint's DCP metadata, packed (`loadplan.pack`), as the holder of its
    preferred copy read and verified it; {"error"} where that failed there."""
    src, path = plan["meta"]
    packed: dict[str, Any] | None = None
    if comm.rank == src:
        try:
            packed = loadplan.pack(dcpmeta.read(Path(path), manifest))
        except (CheckpointError, OSError) as e:
            packed = {"error": reason_of(e)}
    return comm.broadcast(packed, src=src)


def _reads(
    comm: LocalComm | GroupComm,
    manifest: layout.Manifest,
    meta: Mapping[str, Any],
    flat: Mapping[str, torch.Tensor] | None,
) -> dict[str, list[tuple[int, int]]] | None:
    """The files this rank's load of `flat` will read (its shards', with the byte ranges it reads, their block
    checksums and its rank state), planned as the load plans them; None (every file) without a state, without the
    metadata, or where the state does not fit the checkpoint: the load says why."""
    if flat is None or "error" in meta:
        return None
    try:
        files = ShardReader("the chosen checkpoint", manifest, meta, comm, names=flat).planned_ranges(dict(flat))
    except Exception:  # adapter boundary (DCP's planner): the whole copy is made, and the load raises what is wrong
        return None
    own = layout.rank_state_name(comm.rank)
    return files | ({own: []} if own in manifest.files else {})


def _held(plan: Mapping[str, Any], leader: int) -> list[str]:
    """The files of the manifest node `leader`'s copy holds, as `narrow` named them."""
    rels = [rel for *_, files in plan["links"].get(leader, []) for rel in files]
    return sorted(set(rels + [rel for m in plan["moves"] if m["to"] == leader for rel in m["files"]]))


def _tier_of(plan: Mapping[str, Any], leader: int) -> str:
    """A node's tier for the load: `memory` when every part it reads was in its own memory, `peers` else."""
    received = any(m["to"] == leader for m in plan["moves"])
    return PEERS if received or any(t != MEMORY for _, _, t, _ in plan["links"].get(leader, [])) else MEMORY


def _checker(manifest: layout.Manifest, step: int, part: str, expected: list[str]) -> Any:
    return lambda raw: check_offer(raw, manifest, step, part, expected)


def _kept(
    recvs: list[Transfer], alone: Collection[str], manifest: layout.Manifest
) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """The shard files received that only the leader reads (`alone`): its load reads them as received, verified on
    arrival, so they are neither written into the copy nor read back from it (trainer/checkpoint/DESIGN.md, Recovery
    from peers)."""
    only = set(alone)
    return {
        rel: [(0, torch.frombuffer(data, dtype=torch.uint8))] if len(data) else []
        for r in recvs
        for rel, data in r.got.items()
        if rel in only and isinstance(data, memoryview) and _sidecar_of(rel, manifest) is not None
    }


def _assemble(
    partial: Path,
    links: list[list[Any]],
    recvs: list[Transfer],
    raw: bytes,
    held: list[str],
    kept: Collection[str],
) -> None:
    """The leader: its copy in `partial`: the files received and those of its own copies (linked in
    memory, copied from a disk) but those `kept`, the manifest and `subset.json` naming the files it holds."""
    listed = nodes.subset_file_bytes([rel for rel in held if rel not in kept])  # what the directory holds
    got: dict[str, bytes | memoryview] = {layout.MANIFEST_NAME: raw, nodes.SUBSET_FILE: listed}
    for r in recvs:
        got |= {rel: data for rel, data in r.got.items() if rel not in kept}
    write_part(partial, got)
    for _, path, _, rels in links:
        for rel in (r for r in rels if r not in kept):
            src = safefile.resolve_inside(path, rel)
            try:
                os.link(src, partial / rel, follow_symlinks=False)
            except OSError:  # another filesystem (a disk's copy)
                shutil.copyfile(src, partial / rel, follow_symlinks=False)
