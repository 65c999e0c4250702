"""The node's memory tier on the writer's side: each committed save written again into a tmpfs directory by the
store's protocol, with retention of its own; in a job of several nodes each node's part, and its peers' ring
(trainer/checkpoint/DESIGN.md, The memory tier, Peer memories).
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Any

import structlog

from ftsup import memtier
from ftsup.store import nodes
from ftsup.store.errors import CheckpointError
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer.checkpoint import rankenv
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.commit import Committer, StagedSave, log_quietly
from ftsup.trainer.checkpoint.peermsg import assign
from ftsup.trainer.checkpoint.peers import Ring

log = structlog.get_logger("ftsup.checkpoint")


def open_tier(
    tier: memtier.MemoryTier, comm: LocalComm | GroupComm, node: str | None = None, local_rank: int = 0
) -> tuple[Committer | None, Ring | None]:
    """The memory tier's committer (a collective over the engine's group), and where the job spans more than one node
    (`node`: this rank's node id, its host name without one) the ring of peers: each node's memory then holds its own
    ranks' files and its peers' parts. (None, None), logged, where the nodes' ranks cannot be told apart. A
    directory that is a link, not a directory, or another user's is refused with a CheckpointError naming it, on
    every rank."""
    me = node or socket.gethostname()[:255]
    members = comm.gather((me, tier.domain or me, local_rank == 0))
    verdict: dict[str, Any] | None = None
    if comm.rank == 0:
        assert members is not None
        verdict = _ring_verdict(members, tier.replicas)
    verdict = comm.broadcast(verdict)
    if "off" in verdict:
        if comm.rank == 0:
            log.warning("checkpoint_memory_tier_off", path=tier.dir, reason=verdict["off"])
        return None, None
    ring = None
    if "targets" in verdict:
        ranks = {n: tuple(r) for n, r in verdict["ranks"].items()}
        leaders = {n: int(r) for n, r in verdict["leaders"].items()}
        targets = {n: tuple(t) for n, t in verdict["targets"].items()}
        ring = Ring(me, ranks, leaders, targets, tier.keep_last)
    leader = ring.leaders[me] == comm.rank if ring is not None else comm.rank == 0
    mine = _prepare(tier.dir) if leader else {}
    problems = comm.gather(mine.get("error"))
    errors = comm.broadcast([p for p in problems or () if p] if comm.rank == 0 else None)
    if errors:
        raise CheckpointError("; ".join(errors))
    if ring is not None and comm.rank == 0:
        short = {n: len(t) for n, t in ring.targets.items() if len(t) < tier.replicas}
        log.info("checkpoint_memory_peers", path=tier.dir, targets={n: list(t) for n, t in ring.targets.items()})
        if short:
            reason = "not enough nodes of other failure domains for every replica"
            log.warning("checkpoint_memory_replicas_short", replicas=tier.replicas, short=short, reason=reason)
    committer = Committer(
        Path(tier.dir),
        comm,
        o_direct=False,  # a tmpfs refuses it
        retention=RetentionPolicy(keep_last=tier.keep_last),
        recycle=False,  # nothing to gain in memory, and the pool would hold one checkpoint more
        hook=lambda point, step: None,
        check_finite=False,  # written only after the store's commit, whose staged state was checked
        node=me if ring is not None else None,
        leader=leader,
    )
    return committer, ring


def _ring_verdict(members: list[tuple[str, str, bool]], replicas: int) -> dict[str, Any]:
    """Rank 0: one node (`{}`), the ring of several, or why the tier is off."""
    ranks: dict[str, list[int]] = {}
    leaders: dict[str, list[int]] = {}
    domains: dict[str, set[str]] = {}
    for rank, (node, domain, leader) in enumerate(members):
        ranks.setdefault(node, []).append(rank)
        domains.setdefault(node, set()).add(domain)
        if leader:
            leaders.setdefault(node, []).append(rank)
    if len(ranks) == 1:
        return {}
    if any(len(leaders.get(n, ())) != 1 for n in ranks) or any(len(d) != 1 for d in domains.values()):
        return {"off": "each node must have exactly one first local rank and one failure domain"}
    if not all(nodes.is_node_id(n) for n in ranks):
        return {"off": "a node id is not one (letters, digits, '.', '_', '-'; set FTSUP_NODE_ID)"}
    targets = assign({n: next(iter(d)) for n, d in domains.items()}, replicas)
    return {"ranks": ranks, "leaders": {n: ls[0] for n, ls in leaders.items()}, "targets": targets}


def _prepare(where: str) -> dict[str, str]:
    """Rank 0: the tier's directory made (mode 0700) or found; an error where it is not a directory of ours."""
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        st = os.lstat(where)
    except OSError as e:
        return {"error": f"the memory tier's directory {where} cannot be made ({e.strerror or e}); give another"}
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return {"error": f"the memory tier's directory {where} is a link or not a directory; move it away"}
    if st.st_uid != os.getuid():
        return {"error": f"the memory tier's directory {where} belongs to uid {st.st_uid}, not this user's"}
    return {}


def write(committer: Committer, job: StagedSave) -> bool:
    """`job` (committed in the store) committed in the memory tier too, and its retention applied; a failure is
    logged (`checkpoint_memory_save_failed`), never raised: the store holds the checkpoint."""
    try:
        result = committer.write(job)  # every rank alike: its outcome is broadcast
    except CheckpointError as e:
        if committer.rank == 0:
            log_quietly(log.error, "checkpoint_memory_save_failed", step=job.step, kind=job.kind, reason=str(e))
        return False
    rankenv.report_memory(job.step)  # skipped too: the step is there, committed before
    if committer.leader and not result.skipped:
        committer.retain(job.step)
    return True
