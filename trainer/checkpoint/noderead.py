"""A load's reads where each node keeps its own checkpoint directory: each file from the node's own copy when it
holds it, from the durable tier otherwise (trainer/checkpoint/DESIGN.md, "From a node's own copy").
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ftsup.store import layout, safefile, tiers
from ftsup.store.errors import CheckpointCorruptError, CheckpointError, ManifestError, NoCheckpointError
from ftsup.trainer.checkpoint.durableread import PIECE_BYTES, DurableSource, LazyTier
from ftsup.trainer.checkpoint.shardio import VerifiedFile

log = structlog.get_logger("ftsup.checkpoint")


@dataclass(frozen=True)
class NodeRead:
    """A load in a node-local store: this rank's node's checkpoint directory, and the durable tier."""

    directory: Path
    tier: LazyTier


class NodeSource:
    """The files of the chosen checkpoint (`manifest`) as one rank reads them: its node's copy at `local` where it
    holds them, else the durable tier `tier` (opened, and the checkpoint found there, on first need)."""

    def __init__(self, local: Path, manifest: layout.Manifest, tier: LazyTier, durable: DurableSource | None) -> None:
        self.local = local
        self.manifest = manifest
        self.tier = tier
        self._durable = durable
        self.threads = 8
        self.piece = PIECE_BYTES
        self.local_files = 0
        self.durable_files = 0
        self._same = _same_checkpoint(local, manifest)

    @property
    def bytes_read(self) -> int:
        return self._durable.bytes_read if self._durable is not None else 0

    def durable(self) -> DurableSource:
        if self._durable is None:
            if not self.tier.usable:
                raise CheckpointCorruptError(
                    f"{self.local}: this node's copy lacks files of step {self.manifest.step} and no durable tier is "
                    "configured to read them from",
                    path=str(self.local),
                )
            try:
                pick = tiers.find_durable(self.tier.get(), self.manifest.step)
            except NoCheckpointError as e:  # not committed there (a node's part never came): another step is chosen
                raise CheckpointCorruptError(
                    f"{self.local}: this node's copy lacks files of step {self.manifest.step}, and the durable tier "
                    f"holds no commit of it ({e})",
                    path=str(self.local),
                ) from None
            if pick.manifest != self.manifest:
                raise CheckpointCorruptError(
                    f"{pick.info.path}: not the checkpoint chosen (another manifest for step {self.manifest.step})",
                    path=pick.info.path,
                )
            self._durable = DurableSource(self.tier.get(), pick)
        return self._durable

    def holds(self, rel: str) -> bool:
        """Whether this node's copy holds `rel` at its recorded size (its bytes are verified as they are read)."""
        entry = self.manifest.files.get(rel)
        if not self._same or entry is None:
            return False
        try:
            st = os.stat(safefile.resolve_inside(self.local, rel))
        except (OSError, CheckpointError):
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == entry.size

    def verified_file(self, rel: str, crc_rel: str) -> VerifiedFile:
        if self.holds(rel) and self.holds(crc_rel):
            self.local_files += 1
            return VerifiedFile.in_checkpoint(self.local, self.manifest, rel, crc_rel)
        self.durable_files += 1
        return self.durable().verified_file(rel, crc_rel)

    def read_small(self, rel: str, max_bytes: int) -> bytes:
        """A small file (a rank's state), verified, from where it is."""
        if self.holds(rel):
            self.local_files += 1
            return layout.read_verified(self.local, self.manifest, rel, max_bytes)
        self.durable_files += 1
        source = self.durable()
        raw = tiers.read_verified(source.tier, source.pick, rel, max_bytes)
        source.bytes_read += len(raw)
        return raw

    def report(self, rank: int) -> dict[str, Any]:
        return {
            "rank": rank,
            "step": self.manifest.step,
            "local_files": self.local_files,
            "durable_files": self.durable_files,
            "path": str(self.local),
        }


def _same_checkpoint(local: Path, manifest: layout.Manifest) -> bool:
    """Whether `local` is a copy of the checkpoint `manifest` commits (a node's copy of another save of that step,
    or none at all, is never read from)."""
    try:
        return layout.read_manifest(local) == manifest
    except (ManifestError, OSError):
        return False
