"""Reading files from the checkpoint store as hostile input: no links, no special files, capped sizes and JSON.

Paths a manifest names are checked here too (ftsup/store/DESIGN.md, A hostile store). Stdlib only.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from ftsup.store.errors import CheckpointCorruptError, CheckpointError, ManifestError, os_words

MAX_JSON_DEPTH = 128
"""Deepest JSON nesting accepted in any file of a checkpoint. A state dict's skeleton takes three
JSON levels per level of nesting (`codec`), so this holds states nested 40 deep; Python's JSON
decoder recurses once per level and fails past about 1000."""

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
# Linear-time, whatever the input: escapes go first (outside strings they are not JSON anyway), then
# strings hold no quote. A single pattern for strings with escapes rescans to the end of the file
# from every quote of an unterminated string: quadratic in a file of backslash-quotes.
_ESCAPES = re.compile(rb"\\.", re.DOTALL)
_STRINGS = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]


def validate_relpath(rel: str) -> str:
    """Refuse anything but a plain relative path inside the checkpoint directory."""
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"manifest file path {rel!r} is not a non-empty string")
    if "\\" in rel or "\x00" in rel:
        raise ManifestError(f"manifest file path {rel!r} contains a backslash or NUL byte")
    if rel.startswith("/") or os.path.isabs(rel):
        raise ManifestError(f"manifest file path {rel!r} is absolute; only relative paths are allowed")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ManifestError(f"manifest file path {rel!r} contains '..', '.' or an empty component; refusing it")
    return rel


def resolve_inside(ckpt_dir: str | os.PathLike[str], rel: str) -> Path:
    """Absolute path of `rel` under `ckpt_dir`, refusing symlinks that escape it."""
    validate_relpath(rel)
    base = Path(ckpt_dir).resolve()
    target = (base / rel).resolve()
    if target != base and base not in target.parents:
        raise ManifestError(
            f"manifest file path {rel!r} resolves to {target}, outside the checkpoint {base} "
            "(a symlink escaping the directory); refusing it"
        )
    return target


def open_dir(path: str | os.PathLike[str]) -> int | None:
    """A read-only descriptor of the directory `path` (the caller closes it), or None when it cannot be opened: then
    whatever the caller looks up in it by path says what is wrong."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def open_regular(path: str | os.PathLike[str], what: str, error: type[CheckpointError] = CheckpointCorruptError) -> int:
    """A read-only descriptor of `path` if it is a regular file (not a symlink, FIFO, device,
    socket or directory); raises `error` naming `what` otherwise. The caller closes it."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{what}: is a symbolic link; refusing to follow it") from None
        if e.errno == errno.ENOENT:
            raise error(f"{what}: missing") from None
        raise error(f"{what}: cannot open ({os_words(e)})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise error(f"{what}: cannot stat ({os_words(e)})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{what}: is not a regular file ({_kind(mode)}); refusing to read it")
    return fd


class OpenFiles:
    """A reader of an outside model's files that keeps each open once opened (`opened`), for ranged reads, until
    `close()`; a context manager."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def opened(
        self, name: str, path: str | os.PathLike[str], what: str, size: int, since: str, error: type[CheckpointError]
    ) -> int:
        """The descriptor of the regular file `path` (`open_regular`), opened at the first call for `name`; `error`
        naming `what` unless it is `size` bytes, as read `since` (its metadata, its header)."""
        fd = self._fds.get(name)
        if fd is None:
            fd = open_regular(path, what, error)
            if os.fstat(fd).st_size != size:
                os.close(fd)
                raise error(f"{what}: changed since {since}")
            if hasattr(os, "posix_fadvise"):  # read what is asked for, not a readahead window more
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[name] = fd
        return fd


def read_full(read: Callable[[int, int], bytes], n: int) -> bytes:
    """`n` bytes from `read(count, bytes_so_far)`, fewer only where its source ends: a read that comes back short
    before the end (a network filesystem or a socket may answer so) is followed by reads of the rest."""
    data = read(n, 0)
    while 0 < len(data) < n:
        more = read(n - len(data), len(data))
        if not more:
            break
        data += more
    return data


def pread_full(fd: int, n: int, offset: int) -> bytes:
    """`n` bytes at `offset` of `fd`, fewer only where the file ends (`read_full`)."""
    return read_full(lambda count, done: os.pread(fd, count, offset + done), n)


def read_capped(fd: int, cap: int) -> bytes:
    """What `fd` holds from its offset on, read to its end or to `cap` + 1 bytes, whichever comes first: one byte
    more than allowed, so that a caller sees a file that grew past `cap` while it was read."""
    chunks, left = [], cap + 1
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_regular(
    path: str | os.PathLike[str],
    what: str,
    max_bytes: int,
    *,
    exact: int | None = None,
    error: type[CheckpointError] = CheckpointCorruptError,
) -> bytes:
    """The whole content of the regular file `path`, of at most `max_bytes` (and of exactly
    `exact` bytes when given, e.g. the size a manifest records); raises `error` otherwise,
    without reading more than the cap."""
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if exact is not None and size != exact:
            raise error(f"{what}: size {size} != recorded {exact}")
        if size > max_bytes:
            raise error(f"{what}: {size} bytes, over the {max_bytes}-byte limit for this file; refusing to read it")
        try:
            raw = read_capped(fd, max_bytes)
        except OSError as e:
            raise error(f"{what}: cannot read ({os_words(e)})") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise error(f"{what}: grew past the {max_bytes}-byte limit while being read; refusing it")
    if exact is not None and len(raw) != exact:
        raise error(f"{what}: read {len(raw)} bytes, recorded {exact}")
    return raw


def loads(
    raw: bytes,
    what: str,
    *,
    max_values: int | None = None,
    error: type[CheckpointError] = CheckpointCorruptError,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """`json.loads` of a store file, after checking what would make it fail badly: nesting deeper
    than MAX_JSON_DEPTH, more than `max_values` values (each costs the decoder an object), and
    NaN/Infinity (not JSON, and no field of ours holds them). Raises `error` naming `what`, also for
    a ValueError that `object_pairs_hook` raises (a duplicate key, where a format forbids one)."""
    if not isinstance(raw, bytes):
        raise TypeError("loads() takes the raw bytes of a file")
    skeleton = _STRINGS.sub(b'""', _ESCAPES.sub(b"", raw))  # brackets and commas in strings are not structure
    brackets = skeleton.translate(None, _NOT_BRACKETS)
    if max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > MAX_JSON_DEPTH:
        raise error(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH} levels; refusing to parse it")
    if max_values is not None:
        values = skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{")
        if values > max_values:
            raise error(f"{what}: about {values} JSON values, over the limit of {max_values}; refusing to parse it")
    try:
        return json.loads(raw, parse_constant=_refuse_constant, object_pairs_hook=object_pairs_hook)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{what}: not valid JSON ({e})") from None


def read_json(
    path: str | os.PathLike[str],
    what: str,
    max_bytes: int,
    *,
    max_values: int | None = None,
    error: type[CheckpointError] = CheckpointCorruptError,
) -> Any:
    """`read_regular` then `loads`."""
    return loads(read_regular(path, what, max_bytes, error=error), what, max_values=max_values, error=error)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"
