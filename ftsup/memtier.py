"""The node's memory tier as the supervisor tells the ranks of it: `KEEP:DIR` in `protocol.MEMORY_TIER_ENV` and its
peers `REPLICAS[:DOMAIN]` in `protocol.MEMORY_PEERS_ENV`, read as hostile input (ftsup/store/DESIGN.md, The memory
tier). Stdlib only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_ROOT = "/dev/shm"
"""Where the memory tier lives unless the config says otherwise: a tmpfs, which outlives the ranks, not the node."""
MAX_KEEP = 2
MAX_CHARS = 4096
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
        return f"{self.keep_last}:{self.dir}"

    def encode_peers(self) -> str:
        return f"{self.replicas}:{self.domain}" if self.domain else str(self.replicas)


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


def parse(raw: str, name: str, peers: str = "", peers_name: str = "") -> MemoryTier | None:
    """`KEEP:DIR` (empty: no memory tier) as a MemoryTier, its peers from `REPLICAS[:DOMAIN]` in `peers` (empty: one
    replica, each node its own domain); ValueError naming `name` (or `peers_name`) and what is wrong."""
    if len(raw) > MAX_CHARS:
        raise ValueError(f"{name} is {len(raw)} characters long, more than {MAX_CHARS}")
    text = raw.strip()
    if not text:
        return None
    keep, sep, path = text.partition(":")
    if not sep or keep not in {str(k) for k in range(1, MAX_KEEP + 1)}:
        raise ValueError(f"{name} must be KEEP:DIR with KEEP 1 to {MAX_KEEP} (checkpoints kept), not {text!r:.200}")
    replicas, domain = _parse_peers(peers, peers_name or name)
    return MemoryTier(check_dir(path, name), int(keep), replicas, domain)


def _parse_peers(raw: str, name: str) -> tuple[int, str | None]:
    if len(raw) > MAX_CHARS:
        raise ValueError(f"{name} is {len(raw)} characters long, more than {MAX_CHARS}")
    text = raw.strip()
    if not text:
        return 1, None
    count, sep, domain = text.partition(":")
    if count not in {str(k) for k in range(MAX_REPLICAS + 1)} or (sep and not is_domain(domain)):
        raise ValueError(
            f"{name} must be REPLICAS[:DOMAIN] with REPLICAS 0 to {MAX_REPLICAS} and DOMAIN of letters, digits, "
            f"'.', '_' and '-' (at most 64), not {text!r:.200}"
        )
    return int(count), domain or None
