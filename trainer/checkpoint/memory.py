"""The node's memory tier on the writer's side: each committed save written again into a tmpfs directory by the
store's protocol, with retention of its own (trainer/checkpoint/DESIGN.md, The memory tier).
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import structlog

from ftsup import memtier
from ftsup.store.errors import CheckpointError
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.commit import Committer, StagedSave, log_quietly

log = structlog.get_logger("ftsup.checkpoint")


def open_tier(tier: memtier.MemoryTier, comm: LocalComm | GroupComm) -> Committer | None:
    """The memory tier's committer (a collective over the engine's group); None, logged, where the job spans more
    than one node (each node's memory holds only its own ranks' files: read from there later). A directory that
    is a link, not a directory, or another user's is refused with a CheckpointError naming it, on every rank."""
    hosts = comm.gather(socket.gethostname()[:255])
    verdict: dict[str, str] | None = None
    if comm.rank == 0:
        assert hosts is not None
        verdict = {"off": "the job spans more than one node"} if len(set(hosts)) > 1 else _prepare(tier.dir)
    verdict = comm.broadcast(verdict)
    if "error" in verdict:
        raise CheckpointError(verdict["error"])
    if "off" in verdict:
        if comm.rank == 0:
            log.warning("checkpoint_memory_tier_off", path=tier.dir, reason=verdict["off"])
        return None
    return Committer(
        Path(tier.dir),
        comm,
        o_direct=False,  # a tmpfs refuses it
        retention=RetentionPolicy(keep_last=tier.keep_last),
        recycle=False,  # nothing to gain in memory, and the pool would hold one checkpoint more
        hook=lambda point, step: None,
        check_finite=False,  # written only after the store's commit, whose staged state was checked
    )


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
    if committer.leader and not result.skipped:
        committer.retain(job.step)
    return True
