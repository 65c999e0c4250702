"""A Trainer's own checkpoints in ftsup's store (Hugging Face's `checkpoint-N/`, and Lightning's through
`ftsup.trainer.lightning`): committed by the store's protocol, chosen as its own are (trainer/checkpoint/DESIGN.md,
Trainer checkpoints in the store).

Stdlib and `ftsup.store` only: no torch, no transformers.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from ftsup.protocol import COMMITTED_STEP, SAVE_FAILED_STEP, SAVED_STEP
from ftsup.store import blocksum, checksums, choice, hublayout, layout, safefile
from ftsup.store.errors import CheckpointError, CheckpointSaveError
from ftsup.store.retention import RetentionPolicy, apply_retention, remove_dir

if TYPE_CHECKING:
    from ftsup.trainer.runtime import RuntimeClient

log = structlog.get_logger("ftsup.trainer")

FORMAT = hublayout.TRAINER_FORMAT
"""The manifest metadata's `format` of a committed Trainer checkpoint."""
HF_PREFIX = "checkpoint-"  # transformers' PREFIX_CHECKPOINT_DIR
MAX_FILES = 100_000  # a Trainer checkpoint holds a dozen files (a few hundred with sharded FSDP state)


def hf_checkpoint_dir(output_dir: str | os.PathLike[str], step: int) -> Path:
    """Where the Trainer writes the checkpoint of `step`."""
    return Path(output_dir) / f"{HF_PREFIX}{step}"


@dataclass(frozen=True)
class Committed:
    step: int
    path: str
    files: int
    bytes: int
    skipped: bool = False  # the step was committed already: the Trainer's copy was dropped


def commit_hf_checkpoint(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    step: int,
    *,
    kind: str,
    world_size: int,
    metadata: Mapping[str, Any],
    format: str = FORMAT,
) -> Committed:
    """Commit the Trainer's checkpoint directory `src` as `<root>/step-N` (rank 0 only); its metadata's `format`
    says which Trainer wrote it (FORMAT: Hugging Face's).

    A committed step is never written over: `src` is then removed and the result says `skipped`.
    An inconsistent `step-N` is quarantined first. Raises CheckpointSaveError naming what failed;
    then no `step-N` exists for this save and the previous checkpoint is the latest.
    """
    src, root = Path(src), Path(root)
    final = root / layout.step_dirname(step)
    partial = root / layout.partial_dirname(step)
    try:
        st = os.lstat(src)
    except OSError as e:
        raise CheckpointSaveError(f"step {step}: the Trainer's checkpoint {src} is not there ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointSaveError(f"step {step}: {src} is not a directory (a link or a file); it is not committed")
    root.mkdir(parents=True, exist_ok=True)
    if _committed_already(final, step):
        shutil.rmtree(src)
        return Committed(step, str(final), 0, 0, skipped=True)
    _clear_partials(root, step)
    try:
        try:
            os.rename(src, partial)  # the store and output_dir on one filesystem: the usual case, free
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            shutil.copytree(src, partial, symlinks=True)  # another filesystem: a copy, then the Trainer's goes
            shutil.rmtree(src)
        files = _sync_and_checksum(partial)
        total = sum(f.size for f in files.values())
        manifest = layout.Manifest(
            step=step,
            world_size=world_size,
            kind=kind,
            created_unix=time.time(),
            files=files,
            tensor_bytes=total,
            metadata={**metadata, "step": step, "format": format},
        )
        raw = json.dumps(manifest.to_json(), indent=1).encode()
        layout.parse_manifest(raw, f"{partial}/{layout.MANIFEST_NAME}")  # what a reader will check, checked now
        layout.write_file_durable(partial / layout.MANIFEST_NAME, raw)
        layout.fsync_dir(partial)
        os.rename(partial, final)
        layout.fsync_dir(root)
    except (OSError, CheckpointError) as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointSaveError(f"step {step}: cannot commit {src} into {root}: {e}") from None
    return Committed(step, str(final), len(files), total)


def retain(root: str | os.PathLike[str], policy: RetentionPolicy, newest: int) -> str | None:
    """Apply `policy` after the commit of `newest` (never deleting it); the error, if any, as text:
    a failed deletion must not fail a committed save (the next commit tries again)."""
    try:
        apply_retention(root, policy, protect={newest})
    except (OSError, CheckpointError) as e:
        return str(e)
    return None


ANOTHER_RANK = "another rank failed"
"""A failed save's reason where the leader's own part did not fail."""


def commit_agreed(
    rt: RuntimeClient,
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    step: int,
    *,
    kind: str,
    leader: bool,
    agree: Callable[[bool], bool],
    world_size: int,
    metadata: Mapping[str, Any],
    policy: RetentionPolicy,
    started: float,
    format: str = FORMAT,
    error: str | None = None,
    check: Callable[[Path], object] | None = None,
    timed: bool = False,
    logged: Mapping[str, Any] | None = None,
) -> None:
    """A framework's save whose files are all in `src`, on every rank: the leader commits it as `step-N` of `root`
    (`check(src)` first) unless `error` says what failed already, every rank learns through `agree(ok)` (true on
    every rank) whether it is in, then `settle` (`started`: the save's start, `time.monotonic()`; `logged`: more
    fields of its log line, `timed`: its duration among them as `duration_s`)."""
    committed = None
    if leader and error is None:
        try:
            if check is not None:
                check(Path(src))
            committed = commit_hf_checkpoint(
                src, root, step, kind=kind, world_size=world_size, metadata=metadata, format=format
            )
        except (CheckpointError, OSError) as e:
            error = str(e)
    ok = agree(error is None)
    save_s = time.monotonic() - started
    fields = {**(logged or {}), **({"duration_s": round(save_s, 4)} if timed else {})}
    settle(
        rt,
        leader=leader,
        step=step,
        kind=kind,
        ok=ok,
        error=error,
        committed=committed,
        root=root,
        policy=policy,
        save_s=save_s,
        **fields,
    )


def settle(
    rt: RuntimeClient,
    *,
    leader: bool,
    step: int,
    kind: str,
    ok: bool,
    error: str | None,
    committed: Committed | None,
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    save_s: float,
    **logged: Any,
) -> None:
    """A framework's save ended, on every rank once the ranks agreed on `ok`: on the leader its commit logged (with
    `logged`) and retention applied, or its failure logged; to the supervisor the step committed (for an emergency
    save, that it is in) or an emergency save's failure (the supervisor tells the steps lost)."""
    if leader:
        if committed is not None and not committed.skipped:
            log.info("checkpoint_committed", step=step, kind=kind, **logged, path=committed.path)
            problem = retain(root, policy, step)
            if problem is not None:
                log.warning("checkpoint_retention_failed", step=step, reason=problem)
        elif not ok:
            event = "emergency_save_failed" if kind == "emergency" else "checkpoint_save_failed"
            log.error(event, step=step, kind=kind, reason=error or ANOTHER_RANK)
    if ok:
        figures: dict[str, float] = {"save_s": save_s, COMMITTED_STEP: step}
        if kind == "emergency":
            figures[SAVED_STEP] = step  # the supervisor's cue that the eviction's save is in
        rt.beat(step, None, **figures)
    elif kind == "emergency":
        rt.beat(step, None, **{SAVE_FAILED_STEP: step})


def latest_hf_checkpoint(
    root: str | os.PathLike[str], *, at_most: int | None = None, quarantine: bool = True, format: str = FORMAT
) -> tuple[layout.CheckpointInfo | None, tuple[choice.Passed, ...]]:
    """The newest deep-verified checkpoint under `root` (of a step of at most `at_most`) and what was
    passed over; (None, ...) for a fresh start. Raises CheckpointError when the newest consistent one
    is not one of this `format` (another trainer's store)."""
    picked = choice.choose(root, deep=True, at_most=at_most, quarantine=quarantine)
    if picked.info is not None:
        meta = layout.read_manifest(picked.info.path).metadata
        if meta.get("format") != format:
            raise CheckpointError(
                f"{picked.info.path} was not written by this Trainer under ftsup (metadata format "
                f"{meta.get('format')!r:.40}, not {format!r}); give the Trainer a checkpoint directory of its own"
            )
    return picked.info, picked.passed


def callback_store(checkpoint_dir: Path | None, rt: RuntimeClient, default: Path | None, unknown: str) -> Path:
    """A callback's store: its own `checkpoint_dir`, else the supervisor's (`FTSUP_CHECKPOINT_DIR`), else `default`
    (the Trainer's, None until the callback has seen the Trainer: RuntimeError `unknown` then)."""
    if checkpoint_dir is not None:
        return checkpoint_dir
    if rt.env.checkpoint_dir:
        return Path(rt.env.checkpoint_dir)
    if default is None:
        raise RuntimeError(unknown)
    return default


def resume_choice(
    root: str | os.PathLike[str], rt: RuntimeClient, *, format: str = FORMAT
) -> tuple[layout.CheckpointInfo | None, tuple[choice.Passed, ...]]:
    """`latest_hf_checkpoint` of at most a rollback's bound (`FTSUP_RESUME_BOUND`), as a rank of the job makes it:
    rank 0 quarantines what fails verification and logs what it passed over."""
    rank0 = rt.env.rank == 0
    info, passed = latest_hf_checkpoint(root, at_most=rt.env.resume_bound, quarantine=rank0, format=format)
    if rank0:
        tell_passed(passed)
    return info, passed


def tell_passed(passed: tuple[choice.Passed, ...]) -> None:
    """Log each checkpoint a choice passed over, as `checkpoint_<action>` (quarantined, skipped)."""
    for p in passed:
        log.warning(f"checkpoint_{p.action}", step=p.step, path=p.path, reason=p.reason)


# ---------------------------------------------------------------------- the protocol's parts


def _committed_already(final: Path, step: int) -> bool:
    """True when `step-N` is a consistent checkpoint; an inconsistent one is quarantined (raises
    CheckpointSaveError when it cannot be, or is not a directory, or of an unknown format)."""
    try:
        st = os.lstat(final)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointSaveError(f"{final} exists and is not a directory (a link or a file); remove it to save")
    info = layout.inspect_checkpoint(final)
    if info.consistent:
        return True
    reason = "; ".join(map(str, info.problems))
    if info.unknown_format:
        raise CheckpointSaveError(f"{final} is of a format this ftsup does not read; it is kept ({reason})")
    passed = choice.give_up(final, step, reason)
    if passed.action != choice.QUARANTINED:
        raise CheckpointSaveError(f"{final} is not consistent and could not be quarantined: {passed.reason}")
    return False


def _clear_partials(root: Path, step: int) -> None:
    """Remove torn `.partial` directories of this or older steps (saves commit in order)."""
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for e in os.scandir(dir_fd):
            s = layout.parse_partial_dirname(e.name)
            if s is not None and s <= step:
                remove_dir(dir_fd, e.name)  # a real directory only: a planted link is left
    finally:
        os.close(dir_fd)


def _sync_and_checksum(top: Path) -> dict[str, layout.FileEntry]:
    """Every file under `top`: fsynced (the Trainer does not), sized and checksummed. Anything but
    regular files and directories (a link, a FIFO) fails the commit: a checkpoint holds files."""
    files: dict[str, layout.FileEntry] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        for name in (*dirnames, *filenames):
            mode = os.lstat(here / name).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise CheckpointError(f"{here / name} is neither a file nor a directory; a checkpoint holds files only")
        for name in filenames:
            rel = (here / name).relative_to(top).as_posix()
            if rel == layout.MANIFEST_NAME:
                raise CheckpointError(f"{top} holds a {layout.MANIFEST_NAME} already; it is not a Trainer checkpoint")
            safefile.validate_relpath(rel)
            if len(files) >= MAX_FILES:
                raise CheckpointError(f"{top} holds more than {MAX_FILES} files")
            files[rel] = _entry(here / name)
        layout.fsync_dir(here)
    if not files:
        raise CheckpointError(f"{top} is empty")
    return files


def _entry(path: Path) -> layout.FileEntry:
    fd = safefile.open_regular(path, str(path), CheckpointError)
    with open(fd, "rb", buffering=0) as f:
        os.fsync(f.fileno())
        crcs = checksums.stream_block_crcs(f)
        size = os.fstat(f.fileno()).st_size
    return layout.FileEntry(size, checksums.checksum_from_block_crcs(crcs, blocksum.CURRENT))
