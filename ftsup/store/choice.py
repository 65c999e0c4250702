"""Choosing the checkpoint to resume from: the newest consistent one, and each one passed over with why.

One definition for the supervisor and the loader; a rollback's `abandon` too (ftsup/store/DESIGN.md, The resume
choice).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from ftsup.store import layout

QUARANTINED = "quarantined"
SKIPPED = "skipped"
ABANDONED = "abandoned"
ABANDONED_SUFFIX = ".abandoned"


@dataclass(frozen=True)
class Passed:
    """A committed checkpoint that was not chosen: `action` is QUARANTINED (renamed to `moved_to`)
    or SKIPPED (left where it is)."""

    path: str
    step: int
    action: str
    reason: str
    moved_to: str | None = None

    def __str__(self) -> str:
        where = f" (now {Path(self.moved_to).name})" if self.moved_to else ""
        return f"{Path(self.path).name} {self.action}{where}: {self.reason}"


@dataclass(frozen=True)
class Choice:
    info: layout.CheckpointInfo | None
    """The checkpoint to resume from; None: no consistent one (a fresh start)."""
    passed: tuple[Passed, ...] = ()


def choose(
    root: str | os.PathLike[str],
    *,
    deep: bool = False,
    at_most: int | None = None,
    quarantine: bool = True,
    exclude: Collection[str] = (),
) -> Choice:
    """The newest consistent checkpoint under `root` of a step of at most `at_most`, quarantining
    (when `quarantine`) the broken ones newer than it. `exclude`: paths already given up on (a
    load that failed after this check passed, whose quarantine failed too)."""
    passed: list[Passed] = []
    for step, path in reversed(layout.committed_dirs(root)):
        if (at_most is not None and step > at_most) or str(path) in exclude:
            continue
        info = layout.inspect_checkpoint(path, deep=deep)
        if info.consistent:
            return Choice(info, tuple(passed))
        reason = "; ".join(map(str, info.problems))
        passed.append(give_up(path, step, reason, quarantine=quarantine and not info.unknown_format))
    return Choice(None, tuple(passed))


def give_up(path: str | os.PathLike[str], step: int, reason: str, *, quarantine: bool = True) -> Passed:
    """Quarantine `path` (or, when told not to or when the rename fails, leave it) and say so."""
    if not quarantine:
        return Passed(str(path), step, SKIPPED, reason)
    try:
        moved = layout.quarantine(path)
    except OSError as e:
        return Passed(str(path), step, SKIPPED, f"{reason}; it could not be quarantined ({e.strerror or e})")
    return Passed(str(path), step, QUARANTINED, reason, str(moved))


def abandon(root: str | os.PathLike[str], after: int, reason: str) -> tuple[Passed, ...]:
    """Rename every committed checkpoint of a step after `after` to `<name>.abandoned` (`.abandoned.1`, ... when
    taken): a run rolled back to `after` must not resume from the timeline it left, nor find those steps taken
    when it saves them again (a committed step is never written over). Kept as they were, never deleted; one that
    cannot be renamed is SKIPPED, with the reason."""
    out: list[Passed] = []
    for step, path in layout.committed_dirs(root):
        if step <= after:
            continue
        dst = path.with_name(path.name + ABANDONED_SUFFIX)
        n = 1
        while os.path.lexists(dst):
            dst = path.with_name(f"{path.name}{ABANDONED_SUFFIX}.{n}")
            n += 1
        try:
            os.rename(path, dst)
        except FileNotFoundError:
            continue  # gone since it was listed (another node's supervisor abandoned it)
        except OSError as e:
            out.append(Passed(str(path), step, SKIPPED, f"{reason}; it could not be renamed ({e.strerror or e})"))
            continue
        out.append(Passed(str(path), step, ABANDONED, reason, str(dst)))
    if any(p.action == ABANDONED for p in out):
        layout.fsync_dir(root)
    return tuple(out)
