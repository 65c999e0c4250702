"""The node's memory tier as its directory holds it now: its use, its own committed steps, and the replicas of its
peers' parts (`peers/<node>/step-N/`), read as hostile input and never through a link; for `ftsup status` and the
metrics (docs/cli.md, ftsup status).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ftsup import memtier
from ftsup.store import layout, nodes

PEERS_DIRNAME = memtier.PEERS_DIRNAME
MAX_PEERS = 64  # replicas of more nodes than this are not listed


def held_bytes(path: Path) -> int:
    """The bytes of the files under the directory `path` (never through a link; 0 where it is none)."""
    held = 0
    if path.is_dir() and not path.is_symlink():
        for root, _, names in os.walk(path):
            for name in names:
                try:
                    held += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    pass  # gone meanwhile
    return held


def read(where: Path, replicas: int, keep_last: int) -> dict[str, Any]:
    """{dir, bytes_used, bytes_free, replicas_configured, keep_last, steps, replicas: {node: steps}}."""
    held: dict[str, list[int]] = {}
    try:
        for e in sorted(os.scandir(where / PEERS_DIRNAME), key=lambda e: e.name):
            if nodes.is_node_id(e.name) and e.is_dir(follow_symlinks=False) and len(held) < MAX_PEERS:
                held[e.name] = [s for s, _ in layout.committed_dirs(e.path)]
    except OSError:
        pass  # none held, or the tier not made yet
    try:
        st = os.statvfs(where)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return {
        "dir": str(where),
        "bytes_used": held_bytes(where),
        "bytes_free": free,
        "replicas_configured": replicas,
        "keep_last": keep_last,
        "steps": [s for s, _ in layout.committed_dirs(where)],
        "replicas": held,
    }
