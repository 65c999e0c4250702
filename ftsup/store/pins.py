"""Pins: checkpoints an operator marked to be kept, and the journal of who pinned what and why.

Everything in `pins/` is read as hostile input; a bad pin never lets its checkpoint go (ftsup/store/DESIGN.md,
Retention: what is kept). Stdlib only.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import json
import math
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftsup.store import layout, safefile
from ftsup.store.errors import CheckpointError, os_words

PINS_DIRNAME = "pins"
JOURNAL_NAME = "journal.jsonl"
PIN_VERSION = 1
MAX_PIN_BYTES = 64 * 1024
"""A pin file's cap: its fields take a few hundred bytes (a reason of MAX_TEXT_CHARS included)."""
MAX_TEXT_CHARS = 1000
"""Longest `who` or `reason` accepted, read or written."""
MAX_PINS = 4096
"""Most pin files read; a `pins/` holding more is not readable (retention then deletes nothing)."""
MAX_STEP = 10**18  # as a manifest's step

_PIN_NAME = re.compile(r"^step_(\d{10,18})\.json$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FIELDS = ("v", "step", "who", "reason", "pinned_unix")


class PinError(CheckpointError):
    """A pin cannot be written, removed or read (the message names the file and what is wrong)."""


@dataclass(frozen=True)
class Pin:
    step: int
    who: str
    reason: str
    pinned_unix: float

    def to_json(self) -> dict[str, Any]:
        return {
            "v": PIN_VERSION,
            "step": self.step,
            "who": self.who,
            "reason": self.reason,
            "pinned_unix": self.pinned_unix,
        }


@dataclass(frozen=True)
class PinProblem:
    """A file in `pins/` that is named as a pin but is not a good one (or `pins/` itself)."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{PINS_DIRNAME}/{self.name}: {self.reason}" if self.name else f"{PINS_DIRNAME}: {self.reason}"


@dataclass(frozen=True)
class PinSet:
    """What `pins/` holds: the good pins, the problems, and every step kept because of either."""

    pins: tuple[Pin, ...] = ()
    problems: tuple[PinProblem, ...] = ()
    kept: frozenset[int] = frozenset()
    """The steps of the good pins and of the files named as pins that do not parse."""
    readable: bool = True
    """False when `pins` exists but could not be read (a link, a file, too many entries, an I/O
    error): then nothing is known to be unpinned, and retention deletes no checkpoint."""


def pin_name(step: int) -> str:
    return f"step_{step:010d}.json"


def parse_pin_name(name: str) -> int | None:
    m = _PIN_NAME.match(name)
    return int(m.group(1)) if m else None


def operator() -> str:
    """Who is asking, as pins and the journal record it: `user@host pid N`."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (a container)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def parse_pin(raw: bytes, where: str, *, step: int | None = None) -> Pin:
    """A pin file's bytes, strictly: exactly the schema's fields and types, `step` the one its
    name says (when given). Raises PinError naming `where`."""
    if len(raw) > MAX_PIN_BYTES:
        raise PinError(f"{where}: {len(raw)} bytes, over the {MAX_PIN_BYTES}-byte limit of a pin file")
    obj = safefile.loads(raw, where, max_values=64, error=PinError)
    if not isinstance(obj, dict):
        raise PinError(f"{where}: not a JSON object")
    if obj.get("v") != PIN_VERSION or type(obj.get("v")) is not int:
        raise PinError(f"{where}: version {obj.get('v')!r}, this ftsup reads version {PIN_VERSION}")
    if sorted(obj) != sorted(_FIELDS):
        raise PinError(f"{where}: fields {sorted(obj)}, expected {sorted(_FIELDS)}")
    got = obj["step"]
    if type(got) is not int or not 0 <= got < MAX_STEP:
        raise PinError(f"{where}: step {got!r} is not a step number")
    if step is not None and got != step:
        raise PinError(f"{where}: holds step {got}, but its name says step {step}")
    for key in ("who", "reason"):
        if not isinstance(obj[key], str) or len(obj[key]) > MAX_TEXT_CHARS:
            raise PinError(f"{where}: {key} is not a string of at most {MAX_TEXT_CHARS} characters")
    when = obj["pinned_unix"]
    if type(when) not in (int, float) or not math.isfinite(when) or when < 0:
        raise PinError(f"{where}: pinned_unix {when!r} is not a time")
    return Pin(got, obj["who"], obj["reason"], float(when))


def read_pins(root: str | os.PathLike[str]) -> PinSet:
    """The pins of the store `root` (no `pins/`: none). Never raises for what is in the store."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return PinSet()  # no store, no pins: there is nothing to keep either
    try:
        return read_pins_at(root_fd)
    finally:
        os.close(root_fd)


def read_pins_at(root_fd: int) -> PinSet:
    """`read_pins` of the store open as `root_fd`; every file opened relative to it, never through a link."""
    try:
        pins_fd = os.open(PINS_DIRNAME, _DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return PinSet()
    except OSError as e:
        return PinSet(problems=(PinProblem("", _unusable(root_fd, e)),), readable=False)
    try:
        names = []
        with os.scandir(pins_fd) as it:
            for entry in it:
                if entry.name.startswith("step_"):
                    names.append(entry.name)
                    if len(names) > MAX_PINS:
                        reason = f"holds more than {MAX_PINS} pin files; refusing to read them"
                        return PinSet(problems=(PinProblem("", reason),), readable=False)
        pins, problems, kept = [], [], set()
        for name in sorted(names):
            step = parse_pin_name(name)
            if step is None:
                problems.append(PinProblem(name, "not a pin name (step_NNNNNNNNNN.json); ignored"))
                continue
            kept.add(step)  # a pin that does not parse still keeps its checkpoint
            try:
                pins.append(parse_pin(_read_at(pins_fd, name), f"{PINS_DIRNAME}/{name}", step=step))
            except PinError as e:
                problems.append(PinProblem(name, f"{_without_where(str(e), name)}; its checkpoint is kept"))
        return PinSet(tuple(pins), tuple(problems), frozenset(kept))
    except OSError as e:
        return PinSet(problems=(PinProblem("", f"cannot be read ({os_words(e)})"),), readable=False)
    finally:
        os.close(pins_fd)


def pin(root: str | os.PathLike[str], step: int, *, who: str, reason: str, now: float) -> Pin:
    """Pin the consistent checkpoint `step` of the store `root` and journal it; PinError when that
    step is not a consistent checkpoint, is pinned already, or the pin cannot be written (then
    nothing is left of it)."""
    _check_text(who, reason)
    _consistent(root, step)
    record = Pin(step, who, reason, now)
    with _Pins(root, create=True) as fd:
        name = pin_name(step)
        try:
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
        except FileExistsError:
            raise PinError(f"step {step} is pinned already ({PINS_DIRNAME}/{name}); unpin it first") from None
        try:
            try:
                os.fchmod(out, 0o644)  # whatever the umask: anyone who reads the store sees why it is kept
                _write_all(out, (json.dumps(record.to_json()) + "\n").encode())
                os.fsync(out)
            finally:
                os.close(out)
            os.fsync(fd)
            # Retention may have let the checkpoint go between the check above and the pin: say so
            # rather than leave a pin of nothing.
            _consistent(root, step)
            _journal(fd, "pin", record)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
            raise
    return record


def unpin(root: str | os.PathLike[str], step: int, *, who: str, reason: str, now: float) -> Pin:
    """Remove the pin of `step` (only a file that parses as that pin) and journal it; returns the
    pin removed. PinError when there is none or it is not a pin file (then it is left as it is)."""
    _check_text(who, reason)
    with _Pins(root, create=False) as fd:
        name = pin_name(step)
        try:
            old = parse_pin(_read_at(fd, name), f"{PINS_DIRNAME}/{name}", step=step)
        except FileNotFoundError:
            raise PinError(f"step {step} is not pinned (no {PINS_DIRNAME}/{name} under {root})") from None
        except PinError as e:
            raise PinError(f"{e}; not a pin this ftsup wrote, so it is left as it is (remove it by hand)") from None
        _journal(fd, "unpin", Pin(step, who, reason, now), pinned=old)  # first: a failed journal changes nothing
        os.unlink(name, dir_fd=fd)
        os.fsync(fd)
    return old


def read_journal(root: str | os.PathLike[str], max_bytes: int = 16 * 1024 * 1024) -> list[dict[str, Any]]:
    """The journal's records, oldest first (a line that does not parse is skipped): for tests and
    operators; nothing decides from it."""
    path = Path(root) / PINS_DIRNAME / JOURNAL_NAME
    raw = safefile.read_regular(path, str(path), max_bytes, error=PinError)
    out = []
    for line in raw.splitlines():
        try:
            obj = safefile.loads(line, JOURNAL_NAME, max_values=64, error=PinError)
        except PinError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


# --------------------------------------------------------------------------- helpers


class _Pins:
    """A descriptor of `<root>/pins` (made, 0755, when `create`), a real directory only."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool) -> None:
        self.root, self.create, self.fd = Path(root), create, -1

    def __enter__(self) -> int:
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if self.create:
                try:
                    os.mkdir(PINS_DIRNAME, 0o755, dir_fd=root_fd)
                    os.fsync(root_fd)
                except FileExistsError:
                    pass
            try:
                self.fd = os.open(PINS_DIRNAME, _DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError:
                raise PinError(f"no pins under {self.root} (no {PINS_DIRNAME}/)") from None
            except OSError as e:
                why = _unusable(root_fd, e)
                raise PinError(f"{self.root / PINS_DIRNAME} is not a directory of pins: {why}") from None
        finally:
            os.close(root_fd)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _unusable(root_fd: int, e: OSError) -> str:
    """Why `pins` could not be opened as a directory (O_NOFOLLOW | O_DIRECTORY says ENOTDIR for a link too)."""
    try:
        mode = os.lstat(PINS_DIRNAME, dir_fd=root_fd).st_mode
    except OSError:
        mode = 0
    if stat.S_ISLNK(mode):
        return "is a symbolic link; refusing to follow it"
    if e.errno == errno.ENOTDIR:
        return "is not a directory; refusing to use it"
    return f"cannot be opened ({os_words(e)})"


def _consistent(root: str | os.PathLike[str], step: int) -> layout.CheckpointInfo:
    found = [p for s, p in layout.committed_dirs(root) if s == step]
    if not found:
        raise PinError(f"step {step} is not a committed checkpoint under {root}; nothing pinned")
    info = layout.inspect_checkpoint(found[0])
    if not info.consistent:
        problems = "; ".join(str(p) for p in info.problems[:3])
        raise PinError(f"step {step} ({info.path}) is not a consistent checkpoint ({problems}); nothing pinned")
    return info


def _check_text(who: str, reason: str) -> None:
    for key, value in (("who", who), ("reason", reason)):
        if len(value) > MAX_TEXT_CHARS:
            raise PinError(f"the {key} of a pin is at most {MAX_TEXT_CHARS} characters, got {len(value)}")


def _read_at(dir_fd: int, name: str) -> bytes:
    """A pin file's bytes: a regular file (never a link, a FIFO, a device) of at most MAX_PIN_BYTES."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        why = "is a symbolic link; refusing to follow it" if e.errno == errno.ELOOP else f"cannot open ({os_words(e)})"
        raise PinError(f"{PINS_DIRNAME}/{name}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PinError(f"{PINS_DIRNAME}/{name}: is not a regular file; refusing to read it")
        if st.st_size > MAX_PIN_BYTES:
            raise PinError(f"{PINS_DIRNAME}/{name}: {st.st_size} bytes, over the {MAX_PIN_BYTES}-byte limit")
        return safefile.read_capped(fd, MAX_PIN_BYTES)
    finally:
        os.close(fd)


def _journal(pins_fd: int, action: str, record: Pin, pinned: Pin | None = None) -> None:
    """Append one line to the journal (a regular file of ours, never through a link)."""
    entry: dict[str, Any] = {
        "v": PIN_VERSION,
        "action": action,
        "step": record.step,
        "who": record.who,
        "reason": record.reason,
        "unix": record.pinned_unix,
    }
    if pinned is not None:
        entry["pinned"] = pinned.to_json()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(JOURNAL_NAME, flags, 0o644, dir_fd=pins_fd)
    except OSError as e:
        link = e.errno == errno.ELOOP
        why = "is a symbolic link; refusing to follow it" if link else f"cannot append ({os_words(e)})"
        raise PinError(f"{PINS_DIRNAME}/{JOURNAL_NAME}: {why}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PinError(f"{PINS_DIRNAME}/{JOURNAL_NAME}: is not a regular file; refusing to write to it")
        # One write of one line with O_APPEND: concurrent writers never interleave within a line.
        _write_all(fd, (json.dumps(entry) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _without_where(message: str, name: str) -> str:
    return message.removeprefix(f"{PINS_DIRNAME}/{name}: ")
