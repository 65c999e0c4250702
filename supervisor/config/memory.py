"""`checkpoint.memory:` the node's memory tier, where every save also lands, read by `parse_memory` or one
`ConfigError` naming the key; no I/O (docs/checkpoints.md, The memory tier).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ftsup import memtier
from ftsup.supervisor.config import values as config_values
from ftsup.supervisor.config.values import Section, Where


@dataclass(frozen=True)
class MemoryConfig:
    """`checkpoint.memory:` true (a directory under /dev/shm, newest checkpoint kept), a directory, or a mapping of
    these keys. Every save is also committed there, by the store's protocol; a load reads it when it holds the
    newest checkpoint, verified, and the checkpoint dir otherwise. The ranks see it as FTSUP_CHECKPOINT_MEMORY."""

    dir: str | None = None
    """An absolute path on a tmpfs (it outlives the ranks, not the node), the same on every node. Null:
    /dev/shm/ftsup-<job.run_id>."""
    keep_last: int = 1
    """How many of the newest checkpoints it keeps: 1 or 2 (each is a whole checkpoint in the node's memory)."""

    def tier(self, run_id: str) -> memtier.MemoryTier:
        """As the ranks are told of it (`ftsup.memtier`)."""
        return memtier.MemoryTier(self.dir or memtier.default_dir(run_id), self.keep_last)


def parse_memory(value: object, where: Where) -> MemoryConfig | None:
    """`checkpoint.memory` as given: null or false (none), true, a directory, or a mapping of the keys above."""
    if value is None or value is False:
        return None
    if value is True:
        return MemoryConfig()
    if isinstance(value, str):
        value = {"dir": value}
    if not isinstance(value, Mapping):
        got = config_values.describe(value)
        where.fail(f"expected true, a directory or a mapping with dir and keep_last, got {got}")
    sec = Section(where, value, MemoryConfig)
    return MemoryConfig(
        dir=sec.nullable("dir", _directory),
        keep_last=sec.optional("keep_last", config_values.integer(1, memtier.MAX_KEEP)),
    )


def _directory(value: object, where: Where) -> str:
    text = config_values.string(value, where)
    try:
        return memtier.check_dir(text, "checkpoint.memory.dir")
    except ValueError as e:
        where.fail(f"{e}; write one such as /dev/shm/ftsup-myjob")
