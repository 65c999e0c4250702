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
    replicas: int = 1
    """In a job of several nodes: how many other nodes' memories also hold each node's part of a checkpoint, 0 to 3
    (0: none). A node lost whole is restored from them. Each costs that node's part in every peer's memory."""
    domain: str | None = None
    """This node's failure domain (a rack, a switch, a zone): a node's replica never lands on a node of the same
    domain. Null: the node is a domain of its own. Letters, digits, '.', '_' and '-'."""

    def tier(self, run_id: str) -> memtier.MemoryTier:
        """As the ranks are told of it (`ftsup.memtier`)."""
        return memtier.MemoryTier(self.dir or memtier.default_dir(run_id), self.keep_last, self.replicas, self.domain)


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
        where.fail(f"expected true, a directory or a mapping with dir, keep_last, replicas and domain, got {got}")
    sec = Section(where, value, MemoryConfig)
    return MemoryConfig(
        dir=sec.nullable("dir", _directory),
        keep_last=sec.optional("keep_last", config_values.integer(1, memtier.MAX_KEEP)),
        replicas=sec.optional("replicas", config_values.integer(0, memtier.MAX_REPLICAS)),
        domain=sec.nullable("domain", _domain),
    )


def _domain(value: object, where: Where) -> str:
    text = config_values.string(value, where)
    if not memtier.is_domain(text):
        where.fail(f"{text!r:.80} is not a domain name: letters, digits, '.', '_' and '-', at most 64; e.g. rack-3")
    return text


def _directory(value: object, where: Where) -> str:
    text = config_values.string(value, where)
    try:
        return memtier.check_dir(text, "checkpoint.memory.dir")
    except ValueError as e:
        where.fail(f"{e}; write one such as /dev/shm/ftsup-myjob")
