"""What an attempt left in its logs, read back as hostile input: torchrun's report of the ranks that failed, and
the last lines of each rank's own output (docs/design/run-loop.md, What an attempt left in its logs).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from dataclasses import replace
from pathlib import Path

from ftsup.supervisor.policy.events import RankFailure
from ftsup.supervisor.policy.failures import MAX_DETAILED, MAX_LINE_CHARS, TAIL_LINES, culprits

TAIL_BYTES = 64 << 10  # of a rank's output
REPORT_BYTES = 256 << 10  # of the attempt log, where torchrun's report comes last
MAX_REPORTED = 4096  # ranks in one report
MAX_ENTRIES = 64  # looked at in one of torchrun's log directories
PREFIX_TEMPLATE = "[rank${rank}]: "  # torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, set by `launcher`

_PREFIX = re.compile(r"\[rank\d{1,9}\]: ?")
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f]")  # terminal escapes, C0 controls but tab
_RANK = re.compile(r"\s*rank\s*:\s*(\d{1,9}) \(local_rank: (\d{1,9})\)")
_EXIT = re.compile(r"\s*exitcode\s*:\s*(-?\d{1,3}) \(pid: (\d{1,9})\)")
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def ranks_dir(attempt_log: Path) -> Path:
    """torchrun's `--log-dir` for the attempt whose log is `attempt_log`: `attempt-NNNN/` beside `attempt-NNNN.log`."""
    return attempt_log.with_suffix("")


def tail(path: str | os.PathLike[str], *, dir_fd: int | None = None, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last lines of `path` (at most `TAIL_LINES`, each cut to `MAX_LINE_CHARS`): [] for no file, a link or
    anything but a regular file."""
    return _lines(_read_end(path, dir_fd, max_bytes), screen=True)[-TAIL_LINES:]


def _read_end(path: str | os.PathLike[str], dir_fd: int | None, max_bytes: int) -> tuple[bytes, bool]:
    """(up to `max_bytes` from the end of the file, whether that cut off its beginning)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return b"", False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b"", False
        start = max(0, st.st_size - max_bytes)
        return os.pread(fd, max_bytes, start), start > 0
    except OSError:
        return b"", False
    finally:
        os.close(fd)


def _lines(read: tuple[bytes, bool], *, screen: bool = False) -> list[str]:
    """The lines of what was read, split at newlines only (torchrun prefixes each of those: a carriage return in a
    rank's line must not make the rest of it look like a line of torchrun's). With `screen`, each line is what a
    terminal would show of it: the text after its last carriage return (a progress bar's last state)."""
    data, cut = read
    lines = data.decode("utf-8", errors="replace").split("\n")
    if cut and lines:
        lines = lines[1:]  # the first one began before what was read
    if lines and lines[-1] == "":
        lines.pop()
    if screen:
        lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]
    return [_CONTROL.sub("", line)[:MAX_LINE_CHARS].rstrip() for line in lines]


def _open_dir(stack: contextlib.ExitStack, name: str | os.PathLike[str], parent: int | None = None) -> int | None:
    """A directory opened without following a link, closed with `stack` (None: there is no such directory)."""
    try:
        fd = os.open(name, _O_DIR, dir_fd=parent)
    except OSError:
        return None
    stack.callback(os.close, fd)
    return fd


def _subdirs(fd: int) -> list[str]:
    """The names of the directories (not links) in the directory `fd`, at most `MAX_ENTRIES` looked at."""
    names = []
    with contextlib.suppress(OSError), os.scandir(fd) as it:
        for i, entry in enumerate(it):
            if i >= MAX_ENTRIES:
                break
            if entry.is_dir(follow_symlinks=False):
                names.append(entry.name)
    return sorted(names)


def _newest_attempt(run: list[str]) -> int:
    """torchrun's `attempt_<k>` with the highest k (it restarts a worker group under attempt_<k+1>)."""
    ks = [int(n[8:]) for n in run if n.startswith("attempt_") and n[8:].isdigit() and len(n) < 16]
    return max(ks, default=-1)


def rank_output(ranks_dir: Path, local_rank: int) -> list[str]:
    """The last lines of a rank's stderr, else of its stdout, in torchrun's log directory `ranks_dir`."""
    with contextlib.ExitStack() as stack:
        top = _open_dir(stack, ranks_dir)
        for run_name in _subdirs(top) if top is not None else []:  # one per torchrun run: ftsup starts one
            run = _open_dir(stack, run_name, top)
            att = None if run is None else _open_dir(stack, f"attempt_{_newest_attempt(_subdirs(run))}", run)
            rank = None if att is None else _open_dir(stack, str(local_rank), att)
            if rank is not None:
                return tail("stderr.log", dir_fd=rank) or tail("stdout.log", dir_fd=rank)
    return []


def torchrun_report(attempt_log: Path) -> tuple[list[RankFailure], list[str]]:
    """The ranks torchrun reported as failed (its root cause marked), and the last lines it wrote itself."""
    own = [line for line in _lines(_read_end(attempt_log, None, REPORT_BYTES)) if not _PREFIX.match(line)]
    start = max((i for i, line in enumerate(own) if "ChildFailedError" in line), default=None)
    found: list[RankFailure] = []
    if start is not None:
        root, pending = False, None
        for line in own[start:]:
            if line.startswith("Root Cause"):
                root = True
            elif line.startswith("Failures:"):
                root = False
            elif m := _RANK.match(line):
                pending = int(m.group(1)), int(m.group(2))
            elif (m := _EXIT.match(line)) and pending is not None and len(found) < MAX_REPORTED:
                found.append(RankFailure(pending[0], pending[1], int(m.group(2)), int(m.group(1)), root=root))
                pending = None
    return found, own[-TAIL_LINES:]


def gather(attempt_log: Path, ranks_dir: Path) -> tuple[tuple[RankFailure, ...], tuple[str, ...]]:
    """torchrun's report with each failed rank's last lines (for the first `MAX_DETAILED` to be told), and
    torchrun's own last lines."""
    found, own = torchrun_report(attempt_log)
    told = culprits(found)
    for i, f in enumerate(told[:MAX_DETAILED]):
        if f.local_rank is not None:
            told[i] = replace(f, output=tuple(rank_output(ranks_dir, f.local_rank)))
    return tuple(told), tuple(own)
