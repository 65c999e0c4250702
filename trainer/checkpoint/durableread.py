"""A load's reads from the durable tier: the tier opened on first use, and its files as `VerifiedFile`s read by
ranged reads, each piece verified as it lands (trainer/checkpoint/DESIGN.md, "From the durable tier").
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import structlog

from ftsup.store import durable, layout, tiers
from ftsup.store.errors import CheckpointCorruptError, CheckpointError
from ftsup.trainer.checkpoint.shardio import VerifiedFile

log = structlog.get_logger("ftsup.checkpoint")

PIECE_BYTES = 8 << 20
"""A ranged read's size: a multiple of the checksum block (S3 requests cost a round trip each)."""


class LazyTier:
    """The durable tier at `url` (None: none), opened when first used on this rank (an `s3://` tier imports boto3
    then) and closed by `close()`. `failed` is set once the tier failed a choice: the rest of the load goes on
    without it. `timeout_s`: the longest the reads of one checkpoint may take (`bounded`; None: the tier's own
    operation timeout)."""

    def __init__(self, url: str | None, timeout_s: float | None = None) -> None:
        self.url = url
        self.failed = False
        self.timeout_s = timeout_s
        self._tier: durable.DurableTier | None = None
        self._ends: float | None = None

    def get(self) -> durable.DurableTier:
        if self.url is None:
            raise CheckpointError("no durable tier is configured")
        if self._tier is None:
            self._tier = durable.open_tier(self.url)
            self._bound()
        return self._tier

    @contextlib.contextmanager
    def bounded(self) -> Iterator[None]:
        """The reads of one checkpoint: every request to the tier made inside, on any thread, ends within
        `timeout_s` from now (the tier fails it then, with DurableTierError naming the deadline), so that a
        checkpoint the tier delivers a byte at a time is passed over, not waited for."""
        self._ends = time.monotonic() + self.seconds
        self._bound()
        try:
            yield
        finally:
            self._ends = None
            self._bound()

    @property
    def seconds(self) -> float:
        return self.timeout_s if self.timeout_s is not None else durable.DurableOptions().operation_timeout_s

    def _bound(self) -> None:
        if self._tier is not None:
            self._tier.ends_at, self._tier.budget_s = self._ends, self.seconds

    @property
    def usable(self) -> bool:
        return self.url is not None and not self.failed

    def close(self) -> None:
        if self._tier is not None:
            self._tier.close()
            self._tier = None


class DurableSource:
    """The files of the durable checkpoint `pick` of `tier`, as the reader reads them (`reader.FileSource`)."""

    def __init__(self, tier: durable.DurableTier, pick: tiers.DurablePick) -> None:
        self.tier = tier
        self.pick = pick
        self.threads = tier.options.concurrency
        self.piece = PIECE_BYTES
        self.bytes_read = 0
        """Bytes read by `verified_file` (the sidecars); the reader counts the rest."""

    def verified_file(self, rel: str, crc_rel: str) -> VerifiedFile:
        entry = self.pick.manifest.files[rel]
        blocks = -(-entry.size // layout.CHECKSUM_BLOCK_BYTES)
        crc = self.pick.manifest.files.get(crc_rel)
        shown = tiers.object_url(self.tier, self.pick.step, self.pick.token, rel)
        if crc is None or crc.size != 4 * blocks:
            raise CheckpointCorruptError(f"{shown}: its block checksums are missing or not one per block", file=rel)
        sidecar = tiers.read_verified(self.tier, self.pick, crc_rel, layout.SIDECAR_MAX_BYTES)
        fetch = functools.partial(self.tier.read_pieces, self.pick.step, self.pick.token, rel)
        return VerifiedFile.fetched(fetch, entry.size, entry.checksum, sidecar, rel, shown)


def pick_from(chosen: dict[str, object]) -> tiers.DurablePick:
    """The DurablePick rank 0 chose, from what it broadcast (the manifest's bytes)."""
    raw = chosen["raw"]
    if not isinstance(raw, bytes):
        raise CheckpointError("the durable choice broadcast carries no manifest")
    manifest = layout.parse_manifest(raw, f"{chosen['path']}/{layout.MANIFEST_NAME}")
    return tiers.DurablePick(layout.CheckpointInfo(manifest.step, str(chosen["path"]), True), manifest, raw)
