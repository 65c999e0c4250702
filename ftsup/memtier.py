"""The node's memory tier as the supervisor tells the ranks of it: `KEEP:DIR` in `protocol.MEMORY_TIER_ENV`, read
as hostile input (ftsup/store/DESIGN.md, The memory tier). Stdlib only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_ROOT = "/dev/shm"
"""Where the memory tier lives unless the config says otherwise: a tmpfs, which outlives the ranks, not the node."""
MAX_KEEP = 2
MAX_CHARS = 4096


@dataclass(frozen=True)
class MemoryTier:
    """A directory on a tmpfs holding this node's newest `keep_last` checkpoints, beside the checkpoint dir."""

    dir: str
    keep_last: int = 1

    def encode(self) -> str:
        return f"{self.keep_last}:{self.dir}"


def default_dir(run_id: str) -> str:
    """The memory tier's directory of a run whose config names none."""
    return os.path.join(DEFAULT_ROOT, f"ftsup-{run_id}")


def check_dir(path: str, name: str) -> str:
    """`path` if it is an absolute, normalised path of printable characters; ValueError naming `name` otherwise."""
    if not path.startswith("/") or os.path.normpath(path) != path or not path.isprintable() or path == "/":
        raise ValueError(f"{name}: the memory tier's directory must be an absolute, normalised path, not {path!r:.200}")
    return path


def parse(raw: str, name: str) -> MemoryTier | None:
    """`KEEP:DIR` (empty: no memory tier) as a MemoryTier; ValueError naming `name` and what is wrong."""
    if len(raw) > MAX_CHARS:
        raise ValueError(f"{name} is {len(raw)} characters long, more than {MAX_CHARS}")
    text = raw.strip()
    if not text:
        return None
    keep, sep, path = text.partition(":")
    if not sep or keep not in {str(k) for k in range(1, MAX_KEEP + 1)}:
        raise ValueError(f"{name} must be KEEP:DIR with KEEP 1 to {MAX_KEEP} (checkpoints kept), not {text!r:.200}")
    return MemoryTier(check_dir(path, name), int(keep))
