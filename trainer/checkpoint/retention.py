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

import contextlib
import os
import shutil
import stat
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
    spares: int = 0,
) -> list[Path]:
    """Delete what `policy` lets go, and `.partial` directories older than `running_step`.

    `spares`: keep up to this many shard files of deleted checkpoints in `.recycle/` for the
    next saves to write over (see `claim_spare`); 0 empties the pool.
    """
    root = Path(root)
    infos = layout.list_checkpoints(root)
    removed: list[Path] = []
    for step in retention_victims(((i.step, i.consistent) for i in infos), policy, protect):
        path = root / layout.step_dirname(step)
        # Rename first so that a crash mid-delete never leaves a half-deleted "committed" dir.
        doomed = root / f".{path.name}.deleting-{os.getpid()}"
        os.rename(path, doomed)
        _keep_spares(root, doomed, spares)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    _trim_spares(root, spares)
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


# --------------------------------------------------------------------------- recycling

RECYCLE_DIRNAME = ".recycle"
"""Shard files of deleted checkpoints, kept for the next saves to write over.

Writing over a file's existing blocks costs a filesystem less than a new file (no block
allocation, no unwritten-extent conversion in the journal; on a thinly provisioned or
discard-mounted disk, no allocation by the host either). Measured here with O_DIRECT: 512 MiB
written over a spare in a median 0.16 s against 0.31 s into a new file (reading either back
took the same 0.23 s), and the benchmark's blocking 1 GiB save on two ranks was durable in
0.36-0.41 s against 0.58-0.61 s. The pool holds what retention would have deleted
a moment earlier, so it never raises the peak disk usage of a run (a save in flight plus the
checkpoints kept); between saves it holds one checkpoint's shards more than `keep_last`."""


def _keep_spares(root: Path, doomed: Path, spares: int) -> None:
    pool = root / RECYCLE_DIRNAME
    held = len(_pool_files(pool))
    for e in sorted(os.scandir(doomed), key=lambda e: e.name):
        if held >= spares:
            return
        if e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False):
            try:
                pool.mkdir(exist_ok=True)
                os.rename(e.path, pool / f"{doomed.name.lstrip('.')}-{e.name}")
            except OSError:
                return  # e.g. something else named .recycle: recycling must never stop deletion
            held += 1


def _trim_spares(root: Path, spares: int) -> None:
    pool = root / RECYCLE_DIRNAME
    for name in _pool_files(pool)[spares:]:
        with contextlib.suppress(FileNotFoundError):  # claimed by a rank meanwhile
            if (pool / name).is_dir() and not (pool / name).is_symlink():
                shutil.rmtree(pool / name)
            else:
                os.unlink(pool / name)


def _pool_files(pool: Path) -> list[str]:
    try:
        return sorted(os.listdir(pool))
    except (FileNotFoundError, NotADirectoryError):
        return []


def claim_spare(root: str | os.PathLike[str], dest: str | os.PathLike[str]) -> bool:
    """Move a spare shard file from the pool to `dest` (which must not exist); False if none is left.

    Ranks claim concurrently (on a shared filesystem, from several nodes): a rename is atomic, so
    each spare goes to one rank and a rank that loses a race tries the next. The caller writes
    the whole file and sets its size; nothing of the old content survives."""
    pool = Path(root) / RECYCLE_DIRNAME
    for name in _pool_files(pool):
        try:
            if not stat.S_ISREG(os.lstat(pool / name).st_mode):
                continue  # only ever a plain file of ours; anything else is left to trimming
            os.rename(pool / name, dest)
        except FileNotFoundError:
            continue  # another rank took it
        return True
    return False
