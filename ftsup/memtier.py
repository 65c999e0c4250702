"""The node's memory tier as the supervisor tells the ranks of it: `KEEP[/REPLICAS[/DOMAIN]]:DIR` in
`protocol.MEMORY_TIER_ENV`, read as hostile input (ftsup/store/DESIGN.md, The memory tier). Stdlib only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_ROOT = "/dev/shm"
"""Where the memory tier lives unless the config says otherwise: a tmpfs, which outlives the ranks, not the node."""
MAX_KEEP = 2
MAX_CHARS = 4096
PEERS_DIRNAME = "peers"
"""Under the tier's directory: `peers/<node>/step-N/`, the parts of other nodes this node holds."""
RESTORE_DIRNAME = "restore"
"""Under the tier's directory: `restore/step-N.subset/`, the copy of the files a load reads, removed after it."""
MAX_REPLICAS = 3
"""The most other nodes' memories a node's part of a checkpoint is copied to."""
_DOMAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class MemoryTier:
    """A directory on a tmpfs holding this node's newest `keep_last` checkpoints, beside the checkpoint dir."""

    dir: str
    keep_last: int = 1
    replicas: int = 1
    """In a job of several nodes: how many other nodes' memories hold a copy of this node's part (0: none)."""
    domain: str | None = None
    """This node's failure domain: a replica never lands on a node of the same one (None: the node is its own)."""

    def encode(self) -> str:
        peers = f"/{self.replicas}" + (f"/{self.domain}" if self.domain else "")
        return f"{self.keep_last}{'' if peers == '/1' else peers}:{self.dir}"


def default_dir(run_id: str) -> str:
    """The memory tier's directory of a run whose config names none."""
    return os.path.join(DEFAULT_ROOT, f"ftsup-{run_id}")


def check_dir(path: str, name: str) -> str:
    """`path` if it is an absolute, normalised path of printable characters; ValueError naming `name` otherwise."""
    if not path.startswith("/") or os.path.normpath(path) != path or not path.isprintable() or path == "/":
        raise ValueError(f"{name}: the memory tier's directory must be an absolute, normalised path, not {path!r:.200}")
    return path


def is_domain(name: object) -> bool:
    return isinstance(name, str) and bool(_DOMAIN.match(name))


def parse(raw: str, name: str) -> MemoryTier | None:
    """`KEEP[/REPLICAS[/DOMAIN]]:DIR` (empty: no memory tier; REPLICAS 1 and each node its own domain unless given) as
    a MemoryTier; ValueError naming `name` and what is wrong."""
    if len(raw) > MAX_CHARS:
        raise ValueError(f"{name} is {len(raw)} characters long, more than {MAX_CHARS}")
    text = raw.strip()
    if not text:
        return None
    head, sep, path = text.partition(":")
    keep, _, peers = head.partition("/")
    if not sep or keep not in {str(k) for k in range(1, MAX_KEEP + 1)}:
        raise ValueError(f"{name} must be KEEP:DIR with KEEP 1 to {MAX_KEEP} (checkpoints kept), not {text!r:.200}")
    count, slash, domain = peers.partition("/")
    if peers and (count not in {str(k) for k in range(MAX_REPLICAS + 1)} or (slash and not is_domain(domain))):
        raise ValueError(
            f"{name}: its replicas must be KEEP/REPLICAS[/DOMAIN]:DIR with REPLICAS 0 to {MAX_REPLICAS} and DOMAIN of "
            f"letters, digits, '.', '_' and '-' (at most 64), not {head!r:.200}"
        )
    return MemoryTier(check_dir(path, name), int(keep), int(count) if peers else 1, domain or None)
