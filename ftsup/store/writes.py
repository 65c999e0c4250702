"""Files written durably: created new (never through a planted link), fsynced, replaced atomically.

Re-exported by `layout`, where the store's writers have always found them.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durable(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to a new file and fsync it (the directory is the caller's to fsync). The file
    must not exist: whatever is there (a symlink someone planted) is never written through."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Replace `path` with `obj` as JSON, atomically (tmp file, fsync, rename, fsync dir)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a crashed writer of the same pid (a link there is removed, not followed)
    write_file_durable(tmp, json.dumps(obj, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)
