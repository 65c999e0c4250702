"""The supervisor's own directories and files, trusted only once checked: the state directory, its lock, the runtime
directory, and files opened without following links (docs/design/state.md, The state directory). Stdlib only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from ftsup.store.errors import os_words
from ftsup.supervisor.errors import ConfigError, UsageError, error_line
from ftsup.workdir import DIRNAME, ignore_for_git

LOCK_NAME = "supervisor.lock"
_UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; keep a margin
_SOCKET_NAME = "heartbeat.sock"
_CONTROL_NAME = "control.json"
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


SYSTEMD_CONFIG_DIR = Path("/etc/ftsup")  # deploy/systemd/ftsup@.service runs --config /etc/ftsup/%i.yaml
SYSTEMD_STATE_DIR = Path("/var/lib/ftsup")  # ... with StateDirectory=ftsup/%i

T = TypeVar("T")


def default_state_dir(workdir: Path, node_id: str, config_path: Path | None, environ: Mapping[str, str]) -> Path:
    """Where `job.state_dir` is when the config does not say: the same for `ftsup run` inside a
    systemd unit and for `ftsup status` run from a shell.

    1. `$STATE_DIRECTORY` (systemd exports it to a unit with StateDirectory=);
    2. `/var/lib/ftsup/NAME` for a config at `/etc/ftsup/NAME.yaml` (the shipped unit's
       StateDirectory, so that `ftsup status --config /etc/ftsup/NAME.yaml` finds it);
    3. `<workdir>/.ftsup/<node_id>`.
    """
    given = environ.get("STATE_DIRECTORY", "").split(":")[0]
    if given:
        return Path(given)
    if config_path is not None and config_path.parent == SYSTEMD_CONFIG_DIR and config_path.suffix == ".yaml":
        return SYSTEMD_STATE_DIR / config_path.stem
    return workdir / DIRNAME / node_id


def _refuse(what: str, path: Path, why: str, fix: str) -> ConfigError:
    return ConfigError(f"{what}: {path} {why}; {fix}")


def check_dir(path: Path, what: str) -> None:
    """Refuse `path` unless it is a real directory of ours that nobody else can write."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise _refuse(what, path, f"cannot be read: {os_words(e)}", "check the path") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, path, "is not a directory (a link or a file)", "remove it or choose another directory")
    if st.st_uid != os.geteuid():
        raise _refuse(
            what,
            path,
            f"is owned by uid {st.st_uid}, not by this supervisor's uid {os.geteuid()}",
            "another user could have planted files in it: remove it or choose another directory",
        )
    if st.st_mode & 0o022:
        raise _refuse(
            what,
            path,
            f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})",
            f"chmod go-w {path}, or choose another directory",
        )


def _check_ancestors(path: Path, what: str) -> None:
    """Whoever can write a directory above `path` could swap it, or one above it, for one of
    theirs: every directory above it (as written and as resolved) must be root's or ours, and
    writable by no one else unless sticky (as /tmp is)."""
    above = {*path.parents, *Path(os.path.realpath(path)).parents}
    for parent in sorted(above, key=lambda d: len(d.parts)):
        st = os.stat(parent)
        if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise _refuse(
                what,
                path,
                f"is below {parent}, which another user owns or can write",
                "put it where only you (or root) can write",
            )


def ensure_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Create `path` (and missing parents, 0700) if needed, then check it and every directory above it."""
    path = Path(os.path.abspath(path))
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    if missing:
        _check_ancestors(missing[-1], what)  # create nothing where it would be refused
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise _refuse(what, path, f"cannot be created: {os_words(e)}", "check the path") from None
    check_dir(path, what)
    _check_ancestors(path, what)
    if path.parent.name == DIRNAME:
        ignore_for_git(path.parent)
    return path


def _require_own_file(fd: int, path: Path, *, max_bytes: int | None = None, owner: int | None = None) -> None:
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif owner is not None and st.st_uid != owner:
        why = f"is owned by uid {st.st_uid}, not {owner}"
    elif owner is not None and st.st_nlink != 1:
        why = "has other hard links"
    elif max_bytes is not None and st.st_size > max_bytes:
        why = f"is {st.st_size} bytes, more than the {max_bytes} allowed"
    if why is not None:
        os.close(fd)
        raise OSError(f"{path}: {why}; refused")


def _open(path: Path, flags: int, mode: int = 0o600) -> int:
    """os.open that never follows a link at `path` and says so when one is there."""
    try:
        return os.open(path, flags | _NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(f"{path}: is a symbolic link; refused") from None
        raise


def open_append(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a log file of ours for appending (created 0600); never through a link."""
    path = Path(path)
    fd = _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK)
    _require_own_file(fd, path, owner=os.geteuid())
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def mark(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """What tells a file polled for requests changed (inode, size, times; read with `lstat`, never through a link):
    () when there is none; OSError when it cannot be looked at."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ()
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_private(path: str | os.PathLike[str], max_bytes: int, *, owner: int | None = None) -> bytes | None:
    """The bytes of a regular file (None when there is none), never through a link, at most `max_bytes`."""
    path = Path(path)
    try:
        fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    _require_own_file(fd, path, max_bytes=max_bytes, owner=owner)
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes + 1)[:max_bytes]


def read_json(
    path: str | os.PathLike[str],
    max_bytes: int,
    error: type[Exception],
    parse: Callable[[dict[str, Any]], T],
    *,
    owner: int | None = None,
) -> T | None:
    """`parse` of the JSON object in a file as `read_private` reads it (None when there is none); `error(message)`
    raised naming the path and what is wrong: a link, not a regular file, too large, someone else's, not a JSON
    object, or what `parse` raised it or a ValueError for (a parser's own check of a value passed on)."""
    try:
        data = read_private(path, max_bytes, owner=owner)
    except OSError as e:
        raise error(error_line(e)) from None
    if data is None:
        return None
    try:
        body = json_object(data)
    except ValueError as e:
        raise error(f"{path}: {e}") from None
    try:
        return parse(body)
    except (error, ValueError, RecursionError) as e:
        raise error(f"{path}: {e}") from None


def json_object(data: bytes) -> dict[str, Any]:
    """The JSON object `data` holds; ValueError saying why it is not one."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({str(e)[:200]})") from None
    if not isinstance(value, dict):  # JSON's null among them: never taken for a missing file
        raise ValueError("not a JSON object")
    return value


class RequestFile:
    """An operator's request file in the state directory as the loop polls it (at most every `poll_s`): `read()` gives
    its bytes once each time it changes, read as `read_private` reads; what cannot be looked at (told once until it
    can) or read is told to `ignored(why)`."""

    def __init__(
        self, path: Path, max_bytes: int, *, clock: Callable[[], float], poll_s: float, ignored: Callable[[str], None]
    ) -> None:
        self.path = path
        self._max_bytes = max_bytes
        self._clock = clock
        self._poll_s = poll_s
        self._ignored = ignored
        self._seen: tuple[int, ...] | None = None  # the file's mark when last looked at; (-1,): cannot be, told
        self._next = -math.inf

    def read(self) -> bytes | None:
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self._poll_s
        try:
            seen = mark(self.path)
        except OSError as e:
            if self._seen != (-1,):
                self._seen = (-1,)
                self._ignored(f"cannot be looked at ({e.strerror or e})")
            return None
        if seen == self._seen:
            return None
        self._seen = seen
        if not seen:
            return None
        try:
            return read_private(self.path, self._max_bytes, owner=os.geteuid())
        except OSError as e:  # a link, a FIFO, another user's file, too large
            self._ignored(e.strerror or str(e))
            return None


def write_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data`: a new temporary (O_EXCL, never a link), then rename; with
    `durable`, fsync the file and the directory, so a reader sees the old or the new content."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL | O_NOFOLLOW
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a link at `path` itself, never what it points to
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class InstanceLock:
    """An exclusive `flock` on `<state_dir>/supervisor.lock`, which records the holder's pid."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / LOCK_NAME
        fd = _open(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
        _require_own_file(fd, self.path, owner=os.geteuid(), max_bytes=4096)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(
                f"another ftsup run (pid {holder}) is supervising this job: it holds {self.path}; "
                "stop it first, or give this config another job.state_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (removing it would race a new holder)
            self._fd = None


@dataclass(frozen=True)
class RuntimeDir:
    path: Path
    created: bool  # removed at exit only when this supervisor created it

    @property
    def socket(self) -> Path:
        return self.path / _SOCKET_NAME

    @property
    def control(self) -> Path:
        return self.path / _CONTROL_NAME

    @classmethod
    def make(cls, state_dir: Path, environ: Mapping[str, str]) -> RuntimeDir:
        given = environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        if given:
            path = Path(given)
            check_dir(path, "$RUNTIME_DIRECTORY")
            return cls(path, created=False)
        preferred = state_dir / "run"
        if len(str(preferred / _SOCKET_NAME)) <= _UNIX_PATH_MAX:
            if not os.path.lexists(preferred):
                os.mkdir(preferred, 0o700)
            check_dir(preferred, "job.state_dir")
            return cls(preferred, created=True)  # inside the checked state dir: ours
        return cls(Path(tempfile.mkdtemp(prefix="ftsup-")), created=True)  # UNIX socket paths are short

    def remove(self) -> None:
        for p in (self.socket, self.control):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        if self.created:
            try:
                self.path.rmdir()
            except OSError:
                pass
