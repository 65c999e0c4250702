"""Choosing the checkpoint to resume from across the fast tier and the durable one, and reading a durable
checkpoint's small files verified.

One definition for the supervisor and the ranks' load (ftsup/store/DESIGN.md, Durable tier).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ftsup.store import checksums, choice, dcpmeta, durable, layout
from ftsup.store.errors import CheckpointCorruptError, ManifestError, NoCheckpointError

FAST = "fast"
DURABLE = "durable"


@dataclass(frozen=True)
class DurablePick:
    """A committed, checked checkpoint of a durable tier: its check, its manifest parsed and as stored."""

    info: layout.CheckpointInfo
    manifest: layout.Manifest
    raw: bytes

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def token(self) -> str:
        return durable.data_token(self.raw)


@dataclass(frozen=True)
class TierChoice:
    """The checkpoint to resume from and where it is: `tier` FAST (`info` is the local one), DURABLE (`durable` is
    it, `info` its check) or None (no consistent checkpoint in either: a fresh start). `passed`: every checkpoint
    of either tier that was passed over, newest first within each tier, the fast tier's first."""

    tier: str | None
    info: layout.CheckpointInfo | None
    passed: tuple[choice.Passed, ...] = ()
    durable: DurablePick | None = None

    @property
    def step(self) -> int | None:
        return self.info.step if self.info is not None else None

    @property
    def as_choice(self) -> choice.Choice:
        """As the fast tier's choice reads (`info` of either tier, everything passed over)."""
        return choice.Choice(self.info, self.passed)


def choose_durable(
    tier: durable.DurableTier,
    *,
    above: int | None = None,
    at_most: int | None = None,
    deep: bool = False,
    exclude: Collection[str] = (),
    created_after: float | None = None,
) -> tuple[DurablePick | None, tuple[choice.Passed, ...]]:
    """The newest consistent checkpoint of `tier` of a step in (`above`, `at_most`] (None: unbounded), and the ones
    newer than it that were passed over (SKIPPED, with the reason). `exclude`: step URLs (`tier.step_url(step)`)
    already given up on (a load that failed after this check passed). `created_after`: one created before then is
    passed over (see the module docstring). Raises DurableTierError when the tier fails."""
    passed: list[choice.Passed] = []
    for step in sorted(set(tier.committed_steps()), reverse=True):
        if at_most is not None and step > at_most:
            continue
        if above is not None and step <= above:
            break
        url = tier.step_url(step)
        if url in exclude:
            continue
        try:
            info = tier.inspect(step, deep=deep)
            if not info.consistent:
                passed.append(choice.Passed(url, step, choice.SKIPPED, "; ".join(map(str, info.problems))))
                continue
            if created_after is not None and info.created_unix is not None and info.created_unix < created_after:
                why = f"created before step {above} of the fast tier: from a timeline this run has left (a rollback)"
                passed.append(choice.Passed(url, step, choice.SKIPPED, why))
                continue
            manifest, raw = tier.manifest(step)
        except NoCheckpointError:
            continue  # listed, then gone (retention deleted it meanwhile): not a checkpoint
        except ManifestError as e:  # changed since its check
            passed.append(choice.Passed(url, step, choice.SKIPPED, str(e)))
            continue
        return DurablePick(info, manifest, raw), tuple(passed)
    return None, tuple(passed)


def across(
    fast: choice.Choice,
    tier: durable.DurableTier | None,
    *,
    at_most: int | None = None,
    deep: bool = False,
    exclude: Collection[str] = (),
) -> TierChoice:
    """The choice across both tiers, given the fast tier's (`fast`, made with the same `at_most`). With no `tier`,
    or when the fast tier's choice is `at_most` itself, the tier is not read. Raises DurableTierError when the tier
    fails (the caller may go on with `from_fast(fast)`)."""
    if tier is None:
        return from_fast(fast)
    above = fast.info.step if fast.info is not None else None
    if above is not None and at_most is not None and above >= at_most:
        return from_fast(fast)  # nothing newer may be chosen: the tier is not read
    created = fast.info.created_unix if fast.info is not None else None
    pick, passed = choose_durable(tier, above=above, at_most=at_most, deep=deep, exclude=exclude, created_after=created)
    if pick is None:
        return TierChoice(FAST if fast.info else None, fast.info, fast.passed + passed)
    return TierChoice(DURABLE, pick.info, fast.passed + passed, pick)


def from_fast(fast: choice.Choice) -> TierChoice:
    """The fast tier's choice alone, as a TierChoice."""
    return TierChoice(FAST if fast.info else None, fast.info, fast.passed)


def find_durable(tier: durable.DurableTier, step: int, *, deep: bool = False) -> DurablePick:
    """The durable checkpoint of `step`, checked; NoCheckpointError when it is not there, CheckpointCorruptError
    when it is not consistent (naming why)."""
    info = tier.inspect(step, deep=deep)
    if not info.consistent:
        raise CheckpointCorruptError(
            f"{info.path} is not consistent: {'; '.join(map(str, info.problems))}", path=info.path
        )
    manifest, raw = tier.manifest(step)
    return DurablePick(info, manifest, raw)


def object_url(tier: durable.DurableTier, step: int, token: str, rel: str) -> str:
    """Where file `rel` of a durable checkpoint is, as errors name it."""
    if tier.location.is_s3:
        return f"{tier.step_url(step)}/{token}/{rel}"
    return f"{tier.step_url(step)}/{rel}"


def read_verified(tier: durable.DurableTier, pick: DurablePick, rel: str, max_bytes: int) -> bytes:
    """A small file of a durable checkpoint, whole (one ranged read), after checking it against the manifest: of
    the recorded size (at most `max_bytes`) and checksum. CheckpointCorruptError names the object otherwise."""
    entry = pick.manifest.files.get(rel)
    where = object_url(tier, pick.step, pick.token, rel)
    if entry is None:
        raise CheckpointCorruptError(f"{where}: missing from the manifest", path=pick.info.path, file=rel)
    if entry.size > max_bytes:
        raise CheckpointCorruptError(
            f"{where}: {entry.size} bytes recorded, over the {max_bytes}-byte limit", path=pick.info.path, file=rel
        )
    raw = tier.read_range(pick.step, pick.token, rel, 0, entry.size)
    if len(raw) != entry.size or not checksums.checksum_matches(raw, entry.checksum):
        raise CheckpointCorruptError(f"{where}: checksum mismatch", path=pick.info.path, file=rel)
    return raw


def read_dcp_metadata(tier: durable.DurableTier, pick: DurablePick) -> dict[str, object]:
    """A durable checkpoint's `dcp_metadata.json`, verified and its schema checked (`dcpmeta`)."""
    raw = read_verified(tier, pick, layout.DCP_META_NAME, layout.DCP_META_MAX_BYTES)
    return dcpmeta.parse(raw, pick.manifest, object_url(tier, pick.step, pick.token, layout.DCP_META_NAME))
