"""Retention: which committed checkpoints to keep, deleting the rest without ever tearing one, and the
`.recycle` pool of shard files for the next saves to write over.

Stdlib only (ftsup/store/DESIGN.md, Retention: what is kept). Not here: listing and verifying (`layout`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ftsup.protocol import KEEP_OLDER_THAN_STEPS_ENV
from ftsup.store import layout, pins
from ftsup.store.errors import CheckpointError

MAX_STEPS = 10**18  # as a manifest's step


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints to keep."""

    keep_last: int = 3
    """Keep this many of the newest consistent checkpoints (>= 1)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this (None: none extra)."""
    keep_older_than_steps: int = 0
    """Also keep the newest checkpoint at least this many steps older than the latest, at every
    moment (0: none extra): a rollback to before an anomaly needs a checkpoint from before its
    onset, which keep_last alone would have deleted by the time the anomaly is detected. Each
    checkpoint younger than that becomes it in turn as the run goes on, so those are kept too: the
    cost is about keep_older_than_steps / the checkpoint interval checkpoints more, plus one."""

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise CheckpointError(
                f"retention keep_last must be an integer >= 1, got {self.keep_last!r}; "
                "the newest consistent checkpoint is always kept"
            )
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise CheckpointError(f"retention keep_every must be None or an integer >= 1, got {self.keep_every!r}")
        k = self.keep_older_than_steps
        if type(k) is not int or not 0 <= k < MAX_STEPS:
            raise CheckpointError(f"retention keep_older_than_steps must be an integer >= 0, got {k!r}")

    def with_environment(self, env: Mapping[str, str]) -> RetentionPolicy:
        """This policy with at least the history `env` asks for: `FTSUP_KEEP_OLDER_THAN_STEPS`
        (`ftsup.protocol.KEEP_OLDER_THAN_STEPS_ENV`), which the supervisor sets from its
        `anomaly.detection_window_steps`, is a floor under `keep_older_than_steps`; empty or unset,
        nothing changes. CheckpointError naming the variable when its value is not a step count."""
        raw = env.get(KEEP_OLDER_THAN_STEPS_ENV, "").strip()
        if not raw:
            return self
        if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
            raise CheckpointError(
                f"environment variable {KEEP_OLDER_THAN_STEPS_ENV}={raw[:40]!r} is not a number of steps (an "
                "integer >= 0)"
            )
        return replace(self, keep_older_than_steps=max(self.keep_older_than_steps, int(raw)))


def retention_victims(
    steps_consistent: Iterable[tuple[int, bool]],
    policy: RetentionPolicy,
    protect: Iterable[int] = (),
    *,
    pinned: Iterable[int] = (),
) -> list[int]:
    """Pure: which committed steps to delete. Inconsistent ones are left for quarantine/operators;
    `protect`ed and `pinned` steps are kept."""
    items = sorted(steps_consistent)
    consistent = [s for s, ok in items if ok]
    keep = set(protect) | set(pinned)
    keep.update(consistent[-policy.keep_last :])
    if policy.keep_every:
        keep.update(s for s in consistent if s % policy.keep_every == 0)
    if policy.keep_older_than_steps and consistent:
        cut = consistent[-1] - policy.keep_older_than_steps
        old_enough = [s for s in consistent if s <= cut]
        keep.update(old_enough[-1:])
        keep.update(s for s in consistent if s > cut)  # each becomes the one old enough later
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

    `protect`: steps never deleted; the newest of them is the run's own newest checkpoint (the one
    just committed): checkpoints of later steps are not of this run's timeline (planted, copied
    in, or left by a run this one was rolled back from) and are neither deleted nor counted
    against `keep_last`, so they can never push the run's own checkpoints out.
    `spares`: keep up to this many shard files of deleted checkpoints in `.recycle/` for the
    next saves to write over (see `claim_spare`); 0 empties the pool.
    Pinned checkpoints (`pins`) are never deleted, and a pin is looked for again just before each
    deletion (an operator may pin one meanwhile). When `pins/` cannot be read (a link, a file,
    too many entries), no checkpoint is deleted and CheckpointError says why, after the stale
    `.partial` directories are cleaned up.

    Every operation is relative to a descriptor of `root` and never follows a link: what is
    renamed, recycled or removed is a real directory or a plain file of this user's, found under
    its own name (never a name recomputed from a step).
    """
    root = Path(root)
    protect = set(protect)
    newest = max(protect, default=None)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed: list[Path] = []
    try:
        pinned = pins.read_pins_at(root_fd)
        infos = [layout.inspect_checkpoint(p) for s, p in layout.committed_dirs(root) if newest is None or s <= newest]
        victims = set(retention_victims(((i.step, i.consistent) for i in infos), policy, protect, pinned=pinned.kept))
        for info in infos:
            if not pinned.readable:
                break
            if info.step not in victims or not info.consistent:
                continue
            pinned = pins.read_pins_at(root_fd)
            if info.step in pinned.kept or not pinned.readable:
                continue
            name = Path(info.path).name
            # Rename first so that a crash mid-delete never leaves a half-deleted "committed" dir.
            doomed = f".{name}.deleting-{os.getpid()}"
            os.rename(name, doomed, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            _keep_spares(root_fd, doomed, spares)
            remove_dir(root_fd, doomed)
            removed.append(root / name)
        _trim_spares(root_fd, spares)
        for e in list(os.scandir(root_fd)):
            partial_step = layout.parse_partial_dirname(e.name)
            stale_partial = partial_step is not None and running_step is not None and partial_step < running_step
            stale_delete = _DELETING.match(e.name) is not None
            if (stale_partial or stale_delete) and remove_dir(root_fd, e.name):
                removed.append(root / e.name)
        if removed:
            os.fsync(root_fd)
    finally:
        os.close(root_fd)
    if not pinned.readable:
        why = "; ".join(str(p) for p in pinned.problems)
        raise CheckpointError(f"{root}: {why}: no checkpoint is deleted until the pins can be read")
    return removed


def remove_dir(dir_fd: int, name: str) -> bool:
    """Remove the directory `name` under `dir_fd` and everything in it, if it is a real directory
    (never through a symlink, never a file); whatever cannot be removed stays. True if it was one."""
    try:
        if not stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode):
            return False
    except FileNotFoundError:
        return False
    # rmtree with dir_fd works on descriptors (O_NOFOLLOW at every level): a link swapped in for
    # a directory meanwhile is refused, never followed.
    shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)
    return True


# --------------------------------------------------------------------------- recycling

RECYCLE_DIRNAME = ".recycle"
"""Shard files of deleted checkpoints, kept for the next saves to write over.

Writing over a file's existing blocks costs a filesystem less than a new file (no block
allocation, no unwritten-extent conversion in the journal; on a thinly provisioned or
discard-mounted disk, no allocation by the host either; ftsup/store/DESIGN.md, Retention and the
`.recycle` pool). The pool holds what retention would have deleted a moment earlier, so it never
raises the peak disk usage of a run (a save in flight plus the checkpoints kept); between saves it
holds one checkpoint's shards more than `keep_last`.

The pool is used only when it is a real directory owned by this user (created by `apply_retention`);
a symlink or anything else named `.recycle` turns recycling off and is left alone. In it, only
plain files of this user's with one link and a name retention gives them are claimed or trimmed;
anything else is left where it is."""

_DELETING = re.compile(r"^\.step-\d{9,18}\.deleting-\d+$")
_SPARE = re.compile(r"^step-\d{9,18}\.deleting-\d+-shard-\d{5,}\.safetensors$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _keep_spares(root_fd: int, doomed: str, spares: int) -> None:
    if spares <= 0:
        return
    pool_fd = _open_pool(root_fd, create=True)
    if pool_fd is None:
        return  # something else is named .recycle: recycling must never stop deletion
    try:
        held = len(_spares(pool_fd))
        try:
            dfd = os.open(doomed, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return  # not a real directory (swapped for a link meanwhile): nothing to take from it
        try:
            for e in sorted(os.scandir(dfd), key=lambda e: e.name):
                if held >= spares:
                    return
                if e.name.endswith(".safetensors") and _ours(e.stat(follow_symlinks=False)):
                    try:
                        os.rename(e.name, f"{doomed.lstrip('.')}-{e.name}", src_dir_fd=dfd, dst_dir_fd=pool_fd)
                    except OSError:
                        return
                    held += 1
        finally:
            os.close(dfd)
    finally:
        os.close(pool_fd)


def _trim_spares(root_fd: int, spares: int) -> None:
    pool_fd = _open_pool(root_fd, create=False)
    if pool_fd is None:
        return
    try:
        for name in _spares(pool_fd)[max(spares, 0) :]:
            with contextlib.suppress(FileNotFoundError):  # claimed by a rank meanwhile
                os.unlink(name, dir_fd=pool_fd)
    finally:
        os.close(pool_fd)


def _open_pool(root_fd: int, *, create: bool) -> int | None:
    """A descriptor of `.recycle` if it is a real directory of this user's (made now if `create`)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(RECYCLE_DIRNAME, 0o700, dir_fd=root_fd)
    try:
        fd = os.open(RECYCLE_DIRNAME, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:  # absent, a symlink (ELOOP), a file (ENOTDIR): not a pool of ours
        return None
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def _spares(pool_fd: int) -> list[str]:
    """Names of the spares in the pool: plain files of ours, named as retention names them."""
    out = []
    for e in os.scandir(pool_fd):
        if _SPARE.match(e.name):
            with contextlib.suppress(FileNotFoundError):
                if _ours(e.stat(follow_symlinks=False)):
                    out.append(e.name)
    return sorted(out)


def _ours(st: os.stat_result) -> bool:
    """A plain file of this user's with no other name (a hard link would let a save write over
    a file outside the checkpoint)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()


def claim_spare(root: str | os.PathLike[str], dest: str | os.PathLike[str]) -> bool:
    """Move a spare shard file from the pool to `dest` (which must not exist); False if none is left.

    Ranks claim concurrently (on a shared filesystem, from several nodes): a rename is atomic, so
    each spare goes to one rank and a rank that loses a race tries the next. The caller writes
    the whole file and sets its size; nothing of the old content survives."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        pool_fd = _open_pool(root_fd, create=False)
        if pool_fd is None:
            return False
        try:
            for name in _spares(pool_fd):
                try:
                    if not _ours(os.lstat(name, dir_fd=pool_fd)):
                        continue  # replaced since it was listed
                    os.rename(name, dest, src_dir_fd=pool_fd)
                except FileNotFoundError:
                    continue  # another rank took it
                return True
            return False
        finally:
            os.close(pool_fd)
    finally:
        os.close(root_fd)
