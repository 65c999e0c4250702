"""The memory tier as `ftsup status` shows it: its directory's use and room, the checkpoints it holds of its own
node, and the replicas of other nodes' parts (docs/cli.md, ftsup status). Read as hostile input, never through a link.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ftsup.store import layout, nodes
from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.run import memroom

PEERS_DIRNAME = "peers"  # as the engine writes it (trainer/checkpoint/peers.py)
MAX_PEERS = 64  # replicas of more nodes than this are counted, not listed


def gather(cfg: JobConfig) -> dict[str, Any] | None:
    """{dir, bytes_used, bytes_free, replicas_configured, steps, replicas: {node: steps}}; None without the tier."""
    memory = cfg.checkpoint.memory
    if memory is None:
        return None
    where = Path(memory.tier(cfg.job.run_id).dir)
    replicas: dict[str, list[int]] = {}
    try:
        for e in sorted(os.scandir(where / PEERS_DIRNAME), key=lambda e: e.name):
            if nodes.is_node_id(e.name) and e.is_dir(follow_symlinks=False) and len(replicas) < MAX_PEERS:
                replicas[e.name] = [s for s, _ in layout.committed_dirs(e.path)]
    except OSError:
        pass  # none held, or the tier not made yet
    try:
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return {
        "dir": str(where),
        "bytes_used": memroom.held_bytes(where),
        "bytes_free": free,
        "replicas_configured": memory.replicas,
        "keep_last": memory.keep_last,
        "steps": [s for s, _ in layout.committed_dirs(where)],
        "replicas": replicas,
    }


def line(tier: dict[str, Any]) -> str:
    gib = 1 << 30
    free = f", {tier['bytes_free'] / gib:.2f} GiB free" if tier["bytes_free"] is not None else ""
    held = "; ".join(f"{n} steps {s or 'none'}" for n, s in tier["replicas"].items()) or "none"
    own = tier["steps"] or "none"
    return (
        f"memory tier {tier['dir']}: {tier['bytes_used'] / gib:.2f} GiB used{free}; own steps {own}; "
        f"replicas of peers ({tier['replicas_configured']} configured per node): {held}"
    )
