"""Retention: which committed checkpoints to keep, and deleting the rest without ever tearing one.

`RetentionPolicy` keeps the last K consistent checkpoints and, optionally, every N-th step; the
newest consistent checkpoint is always kept (and the one just committed is protected).
Inconsistent checkpoints are never deleted here: loading quarantines them and operators decide.
A deletion renames the directory out of the `step-N` namespace first, so a crash mid-delete
never leaves a half-deleted directory that looks committed. Stale `.partial` directories (of
steps older than the running one) and interrupted deletions are cleaned up as well.

Stdlib-only (the supervisor applies retention too). Not here: listing and verifying (`layout`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint import layout
from trainer.checkpoint.errors import CheckpointError


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints to keep."""

    keep_last: int = 3
    """Keep this many of the newest consistent checkpoints (>= 1)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (None: none extra)."""

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise CheckpointError(
                f"retention keep_last must be an integer >= 1, got {self.keep_last!r}; "
                "the newest consistent checkpoint is always kept"
            )
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise CheckpointError(f"retention keep_every must be None or an integer >= 1, got {self.keep_every!r}")


def retention_victims(
    steps_consistent: Iterable[tuple[int, bool]],
    policy: RetentionPolicy,
    protect: Iterable[int] = (),
) -> list[int]:
    """Pure: which committed steps to delete. Inconsistent ones are left for quarantine/operators."""
    items = sorted(steps_consistent)
    consistent = [s for s, ok in items if ok]
    keep = set(protect)
    keep.update(consistent[-policy.keep_last :])
    if policy.keep_every:
        keep.update(s for s in consistent if s % policy.keep_every == 0)
    return [s for s in consistent if s not in keep]


def apply_retention(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    *,
    protect: Iterable[int] = (),
    running_step: int | None = None,
) -> list[Path]:
    """Delete what `policy` lets go, and `.partial` directories older than `running_step`."""
    root = Path(root)
    infos = layout.list_checkpoints(root)
    removed: list[Path] = []
    for step in retention_victims(((i.step, i.consistent) for i in infos), policy, protect):
        path = root / layout.step_dirname(step)
        # Rename first so that a crash mid-delete never leaves a half-deleted "committed" dir.
        doomed = root / f".{path.name}.deleting-{os.getpid()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    for e in list(os.scandir(root)) if root.is_dir() else []:
        partial_step = layout.parse_partial_dirname(e.name)
        stale_partial = partial_step is not None and running_step is not None and partial_step < running_step
        stale_delete = e.name.startswith(".step-") and ".deleting-" in e.name
        if stale_partial or stale_delete:
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(Path(e.path))
    if removed:
        layout.fsync_dir(root)
    return removed
