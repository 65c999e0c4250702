"""A fast tier's word for "a save is in progress here" (`step-N.staging`, then `step-N.partial/`), for readers that
never import torch (ftsup/store/DESIGN.md, The commit protocol).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

from ftsup.store import layout

_STAGING_RE = re.compile(r"^step-(\d{9,18})\.staging$")


def staging_name(step: int) -> str:
    return layout.step_dirname(step) + ".staging"


def parse_staging_name(name: str) -> int | None:
    m = _STAGING_RE.match(name)
    return int(m.group(1)) if m else None


def mark_staging(root: str | os.PathLike[str], step: int) -> None:
    """Say that step `step`'s save has started (best effort: a folder that cannot be written is left as it is)."""
    with contextlib.suppress(OSError):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(os.path.join(root, staging_name(step)), flags, 0o644))


def clear_staging(root: str | os.PathLike[str], up_to: int) -> None:
    """Remove the markers of step `up_to` and older (regular files only; best effort)."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for e in os.scandir(dir_fd):
                s = parse_staging_name(e.name)
                if s is None or s > up_to:
                    continue
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.lstat(e.name, dir_fd=dir_fd).st_mode):
                        os.unlink(e.name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)


def in_progress(root: str | os.PathLike[str]) -> list[str]:
    """The names under `root` that say a save is in progress (markers and `.partial` directories); none where the
    folder cannot be read."""
    try:
        with os.scandir(root) as entries:
            return [
                e.name
                for e in entries
                if layout.parse_partial_dirname(e.name) is not None or parse_staging_name(e.name) is not None
            ]
    except OSError:
        return []
