"""Whether this node's memory holds the memory tier's share: its own part of a checkpoint and its peers' replicas,
as many as it keeps, and one save more; checked before start against the store's newest checkpoint
(docs/checkpoints.md, The memory tier).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ftsup.store import layout
from ftsup.store.errors import CheckpointError
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.config.values import Where
from ftsup.supervisor.state import memview


def need_bytes(tensor_bytes: int, nodes: int, replicas: int, keep_last: int) -> int:
    """A node's part of a checkpoint of `tensor_bytes` on `nodes` nodes, its replicas of `replicas` peers' parts,
    `keep_last` of each, and one save more in progress."""
    part = -(-tensor_bytes // max(nodes, 1))
    return part * (1 + (replicas if nodes > 1 else 0)) * (keep_last + 1)


def free_bytes(path: Path) -> int:
    """What the filesystem of `path` (or of its nearest existing parent) has free for this user, plus what the tier's
    directory holds already (its copies are replaced as new ones come)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize + memview.held_bytes(path)


def check(cfg: JobConfig, free: Callable[[Path], int] = free_bytes) -> None:
    """`ConfigError` naming checkpoint.memory, with the numbers, where this node's memory cannot hold its share of the
    store's newest checkpoint (none yet: nothing to check)."""
    memory = cfg.checkpoint.memory
    if memory is None:
        return
    try:
        latest = layout.latest_consistent(cfg.checkpoint.dir)
        manifest = layout.read_manifest(latest.path) if latest is not None else None
    except (CheckpointError, OSError):
        return  # the resume choice reports an unreadable store; its size is not known here
    if manifest is None:
        return
    nodes = len(manifest.nodes) if manifest.nodes is not None else 1
    need = need_bytes(manifest.tensor_bytes, nodes, memory.replicas, memory.keep_last)
    where = Path(memory.tier(cfg.job.run_id).dir)
    have = free(where)
    if have < need:
        gib = 1 << 30
        Where(cfg.source).child("checkpoint").child("memory").fail(
            f"{where} has {have / gib:.2f} GiB free, and this node's share of a checkpoint like step {manifest.step} "
            f"({manifest.tensor_bytes / gib:.2f} GiB on {nodes} node(s)) needs {need / gib:.2f} GiB: its part and "
            f"{memory.replicas if nodes > 1 else 0} replica(s), {memory.keep_last} of each, and one save more; "
            "give the tmpfs more room, or lower keep_last or replicas"
        )
