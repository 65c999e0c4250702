"""The memory tier's copies on other nodes: the ring of peers, files sent over the engine's gloo group and verified
on arrival, each node's part of a checkpoint committed in its peers' memories under `peers/<node>/`
(trainer/checkpoint/DESIGN.md, Peer memories).
"""

from __future__ import annotations

import functools
import mmap
import os
import shutil
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from ftsup import memtier
from ftsup.store import layout, nodes, safefile
from ftsup.store.errors import CheckpointCorruptError, CheckpointError
from ftsup.store.retention import RetentionPolicy, apply_retention
from ftsup.trainer.checkpoint.comm import GroupComm
from ftsup.trainer.checkpoint.commit import log_quietly
from ftsup.trainer.checkpoint.peermsg import HEADER_BYTES, check_file, check_offer, offer, rank_files, reason_of
from ftsup.trainer.checkpoint.shardio import PAGE, aligned_buffer, round_up

log = structlog.get_logger("ftsup.checkpoint")

PEERS_DIRNAME = memtier.PEERS_DIRNAME
MEMORY = "memory"
PEERS = "peers"
"""The tiers a save's result names (`SaveResult.tiers`) and a load's (`LoadResult.tier`)."""


@dataclass(frozen=True)
class Ring:
    """Who holds whose part: every node's group ranks, its leader (its first local rank, which writes its memory
    directory), and the nodes holding its replicas."""

    node: str
    ranks: Mapping[str, tuple[int, ...]]
    leaders: Mapping[str, int]
    targets: Mapping[str, tuple[str, ...]]
    keep_last: int = 1

    def sources(self, node: str) -> list[str]:
        """The nodes whose parts `node` holds."""
        return sorted(n for n, t in self.targets.items() if node in t)


@dataclass
class Transfer:
    """One part's files between two group ranks. The sender's: the offer `header`, the files `rels` and `read`
    (rel -> bytes); the receiver's: `check` (the offer -> the files it expects); both: the `manifest` giving their
    sizes; `into` (the receiver's, optional): where each file it receives is written (`mapped_file`), else a buffer.
    Filled by `exchange`: `got` (verified files) or `error`."""

    peer: int
    node: str
    header: bytes = b""
    rels: list[str] = field(default_factory=list)
    read: Callable[[str], bytes | memoryview] | None = None
    check: Callable[[bytes], list[str]] | None = None
    manifest: layout.Manifest | None = None
    got: dict[str, bytes | memoryview] = field(default_factory=dict)
    error: str | None = None
    into: Callable[[str, int], torch.Tensor] | None = None


def exchange(comm: GroupComm, sends: list[Transfer], recvs: list[Transfer]) -> None:
    """A collective in three rounds (offers, answers, files), every rank of the group alike, each with the transfers
    it takes part in. A receiver never takes more than an offer's fixed size before it accepted it, then exactly the
    sizes its own manifest records, each file checked (`peermsg.check_file`) before it is kept."""
    headers = [torch.zeros(HEADER_BYTES, dtype=torch.uint8) for _ in recvs]
    _round(
        comm, [(s.peer, _tensor(s.header)) for s in sends], [(r.peer, h) for r, h in zip(recvs, headers, strict=True)]
    )
    for r, h in zip(recvs, headers, strict=True):
        try:
            assert r.check is not None
            r.rels = sorted(r.check(h.numpy().tobytes()))
        except Exception as e:  # every rank must finish the three rounds, whatever the check raised
            r.error = reason_of(e)
    answers = [torch.zeros(1, dtype=torch.int64) for _ in sends]
    verdicts = [(r.peer, torch.tensor([0 if r.error else 1], dtype=torch.int64)) for r in recvs]
    _round(comm, verdicts, [(s.peer, a) for s, a in zip(sends, answers, strict=True)])
    out: list[tuple[int, torch.Tensor]] = []
    for s, a in zip(sends, answers, strict=True):
        if int(a.item()) != 1:
            s.error = f"group rank {s.peer} refused the offer of node {s.node}'s part"
            continue
        out += [(s.peer, _tensor(_read(s, rel))) for rel in sorted(s.rels)]  # the offer's order
    wanted = [(r, rel) for r in recvs if not r.error for rel in r.rels]
    # One buffer for the files received into memory, its pages populated up front rather than faulted in by the
    # receive, 4 KiB at a time (trainer/checkpoint/DESIGN.md, Peer memories).
    need = sum(round_up(max(_size(r, rel), 1), PAGE) for r, rel in wanted if r.into is None)
    arena = aligned_buffer(need, populate=True, huge=True) if need else None
    incoming, pos = [], 0
    for r, rel in wanted:
        n = max(_size(r, rel), 1)
        if r.into is None:
            assert arena is not None
            incoming.append((r, rel, arena[pos : pos + n]))
            pos += round_up(n, PAGE)
            continue
        try:
            incoming.append((r, rel, r.into(rel, _size(r, rel))))
        except Exception as e:  # the bytes still come: taken into a buffer and dropped, the error is this transfer's
            r.error = r.error or f"{rel}: {reason_of(e)}"
            incoming.append((r, rel, torch.empty(n, dtype=torch.uint8)))
    _round(comm, out, [(r.peer, t) for r, _, t in incoming])
    for r, rel, t in incoming:
        if r.error:
            continue
        data = t.numpy().data[: _size(r, rel)]  # no copy: checked where it was received
        try:
            assert r.manifest is not None
            check_file(rel, data, r.manifest, f"group rank {r.peer}")
            r.got[rel] = data
        except Exception as e:  # as above: the error is this transfer's, and the save's vote says it
            r.error = r.error or reason_of(e)


def _read(s: Transfer, rel: str) -> bytes | memoryview:
    """A file the offer named; where it cannot be read now, zeros of its size, so that the receiver, which waits for
    exactly that, is never left waiting: their checksum fails there."""
    try:
        assert s.read is not None
        return s.read(rel)
    except Exception as e:  # whatever failed, the receiver still gets the size it waits for
        s.error = s.error or f"{rel}: {reason_of(e)}"
        assert s.manifest is not None
        return bytes(s.manifest.files[rel].size)


def _round(comm: GroupComm, outgoing: list[tuple[int, torch.Tensor]], incoming: list[tuple[int, torch.Tensor]]) -> None:
    """Every send and receive of one round posted at once, then waited for: no order among peers can deadlock."""
    works = [dist.isend(t, dist.get_global_rank(comm.group, p), group=comm.group) for p, t in outgoing]
    works += [dist.irecv(t, dist.get_global_rank(comm.group, p), group=comm.group) for p, t in incoming]
    for w in works:
        if w is not None:
            w.wait()


def _tensor(data: bytes | memoryview) -> torch.Tensor:
    if len(data) == 0:
        return torch.zeros(1, dtype=torch.uint8)
    return torch.frombuffer(data if isinstance(data, memoryview) else bytearray(data), dtype=torch.uint8)


def _size(r: Transfer, rel: str) -> int:
    assert r.manifest is not None
    return r.manifest.files[rel].size


def reader(directory: Path, manifest: layout.Manifest) -> Callable[[str], bytes | memoryview]:
    """rel -> the bytes of a file of a committed directory of ours (a regular file inside it, never through a link,
    of the size `manifest` records), mapped rather than copied: the send reads the tmpfs's pages."""

    def read(rel: str) -> bytes | memoryview:
        path = safefile.resolve_inside(directory, rel)
        size = manifest.files[rel].size
        fd = safefile.open_regular(path, str(path))
        try:
            if os.fstat(fd).st_size != size:
                raise CheckpointCorruptError(f"{path}: not of the size its manifest records", path=str(directory))
            if size == 0:
                return b""
            return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))  # writable for torch, never written
        finally:
            os.close(fd)

    return read


def own_dir(path: Path) -> Path:
    """`path` made (mode 0700) or found, a directory and not a link: a write or a deletion under it never goes where
    a link would send it; CheckpointError naming it otherwise."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path} is a link or not a directory; it is not written into")
    return path


def mapped_file(partial: Path, rel: str, size: int) -> torch.Tensor:
    """A new regular file `rel` of `size` bytes under `partial` (never through a link), its space allocated (a full
    tmpfs is an error here, not a SIGBUS in the receive), as a tensor over its shared mapping: a receive into it
    writes the file, with no buffer and no copy between (trainer/checkpoint/DESIGN.md, Peer memories)."""
    path = partial / safefile.validate_relpath(rel)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if size == 0:
            return torch.zeros(1, dtype=torch.uint8)  # the one byte a sender sends for an empty file, not kept
        os.posix_fallocate(fd, 0, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # its pages mapped now, not one fault each
        m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(m, dtype=torch.uint8)


def write_part(partial: Path, files: Mapping[str, bytes | memoryview], *, made: bool = False) -> None:
    """`files` written as new regular files under `partial` (made here unless `made`; never through a link)."""
    if not made:
        os.makedirs(partial, mode=0o700)
    for rel, data in files.items():
        path = partial / safefile.validate_relpath(rel)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def replicate(ring: Ring, comm: GroupComm, memory: Path, step: int) -> bool:
    """Every rank alike, after checkpoint `step` committed in every node's memory: each rank's files sent to its
    node's peers, whose leaders commit each part under `peers/<node>/step-N/` only once every replica verified;
    True then (the same on every rank). A failure is logged (`checkpoint_peer_replica_failed`), never raised: the
    store's checkpoint stands, even where a peer is gone and the group with it."""
    try:
        return _replicate(ring, comm, memory, step)
    except RuntimeError as e:  # the group broken (a peer gone): gloo's errors are RuntimeErrors
        log_quietly(log.error, "checkpoint_peer_replica_failed", step=step, rank=comm.rank, reason=str(e))
        return False


def _replicate(ring: Ring, comm: GroupComm, memory: Path, step: int) -> bool:
    mine = memory / layout.step_dirname(step)
    try:
        manifest = layout.read_manifest(mine)
        raw = (mine / layout.MANIFEST_NAME).read_bytes()
        error = None if manifest.nodes == {n: tuple(r) for n, r in ring.ranks.items()} else "another node layout"
    except (CheckpointError, OSError) as e:
        manifest, raw, error = None, b"", str(e)
    if comm.all_reduce_max(1 if error else 0):
        if comm.rank == 0:
            log_quietly(log.error, "checkpoint_peer_replica_failed", step=step, reason=error or "another rank failed")
        return False
    assert manifest is not None
    rels = rank_files(manifest, [comm.rank])
    header = offer(step, ring.node, rels, manifest)
    read = reader(mine, manifest)
    sends = [
        Transfer(ring.leaders[t], ring.node, header, rels, read, manifest=manifest) for t in ring.targets[ring.node]
    ]
    recvs: list[Transfer] = []
    failed: str | None = None
    partials: dict[str, Path] = {}
    try:
        if ring.leaders[ring.node] == comm.rank:
            for src in ring.sources(ring.node):
                partials[src] = partial = _partial(memory, src, step)
                into = functools.partial(mapped_file, partial)
                for r in ring.ranks[src]:
                    check = _checker(manifest, step, src, rank_files(manifest, [r]))
                    recvs.append(Transfer(r, src, check=check, manifest=manifest, into=into))
    except Exception as e:  # adapter boundary: every rank must reach the exchange and the vote
        failed = reason_of(e)
        recvs = (
            [
                Transfer(r, src, check=_refuse(failed), manifest=manifest)
                for src in ring.sources(ring.node)
                for r in ring.ranks[src]
            ]
            if ring.leaders[ring.node] == comm.rank
            else []
        )
    try:
        exchange(comm, sends, recvs)
        failed = failed or next((t.error for t in sends + recvs if t.error), None)
        if failed is None and recvs:
            _stage(partials, mine, manifest, raw, recvs)
    except Exception as e:  # adapter boundary (gloo's errors are RuntimeErrors): every rank must reach the vote
        failed = reason_of(e)
    ok = comm.all_reduce_max(1 if failed else 0) == 0
    for partial in partials.values():
        _finish(partial, ok)
    if not ok:
        if failed is not None:
            log_quietly(log.error, "checkpoint_peer_replica_failed", step=step, rank=comm.rank, reason=failed)
        return False
    for src in ring.sources(ring.node) if recvs else ():
        _retain(memory / PEERS_DIRNAME / src, ring.keep_last, step)
    if comm.rank == 0:
        log_quietly(
            log.info, "checkpoint_peer_replicated", step=step, targets={n: list(t) for n, t in ring.targets.items()}
        )
    return True


def _checker(manifest: layout.Manifest, step: int, node: str, expected: list[str]) -> Callable[[bytes], list[str]]:
    return lambda raw: check_offer(raw, manifest, step, node, expected)


def _partial(memory: Path, src: str, step: int) -> Path:
    """The leader: `peers/<src>/step-N.partial/`, made afresh, where node `src`'s part is received."""
    partial = own_dir(own_dir(memory / PEERS_DIRNAME) / src) / layout.partial_dirname(step)
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial, mode=0o700)
    return partial


def _refuse(reason: str) -> Callable[[bytes], list[str]]:
    def refuse(raw: bytes) -> list[str]:
        raise CheckpointError(reason)

    return refuse


def _stage(
    partials: Mapping[str, Path], mine: Path, manifest: layout.Manifest, raw: bytes, recvs: list[Transfer]
) -> None:
    """The leader: next to each source node's part, received into `peers/<node>/step-N.partial/`, the checkpoint's
    files of every node (from this node's own committed copy) and `node.json` naming that node."""
    read = reader(mine, manifest)
    common = {rel: read(rel) for rel in manifest.files if nodes.rank_of(rel) is None}
    for src in {r.node for r in recvs}:
        files = common | {layout.MANIFEST_NAME: raw, nodes.NODE_FILE: nodes.node_file_bytes(src)}
        write_part(partials[src], files, made=True)
    for r in recvs:
        r.got.clear()  # the received files' mappings let go


def _finish(partial: Path, ok: bool) -> None:
    final = partial.parent / layout.step_dirname(layout.parse_partial_dirname(partial.name) or 0)
    if ok and not os.path.lexists(final):
        os.rename(partial, final)
    else:
        shutil.rmtree(partial, ignore_errors=True)


def _retain(root: Path, keep_last: int, step: int) -> None:
    try:
        apply_retention(root, RetentionPolicy(keep_last=keep_last), protect=[step], running_step=step + 1)
    except (CheckpointError, OSError) as e:  # a failed deletion must not fail the save: the next one tries again
        log_quietly(log.warning, "checkpoint_peer_retention_failed", path=str(root), reason=str(e))
