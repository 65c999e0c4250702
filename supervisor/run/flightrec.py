"""NCCL's flight recorder for the ranks: the torch settings that make it record and dump, the poke that asks a rank
for its dump before a kill, and the dumps copied into an incident (docs/incidents.md, NCCL's flight recorder).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ftsup.supervisor import statedir
from ftsup.supervisor.errors import SupervisorError
from ftsup.supervisor.state import incidents

DIR_NAME = "nccl"  # in the state directory
BUFFER_ENTRIES = "2000"  # collectives the ring buffer holds
POLL_S = 0.02
KEEP_ATTEMPTS = 2  # dumps of the attempts before the newest kept in DIR_NAME (one a crash left, not collected)
# torch's settings, in groups, the name ftsup sets first: a job that sets any name of a group has made its own choice,
# and none of the group is set. torch warns that the older names (second) are deprecated, so ftsup sets the newer.
BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # collectives recorded
DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # dumps go to `<prefix><rank>`
PIPE = ("TORCH_FR_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")  # a write to `<prefix><rank>.pipe` dumps
ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)  # a collective's timeout dumps too
_NAME = re.compile(r"a(\d{4,10})-rank_\d{1,9}(\.pipe)?")


def prefix(state_dir: Path, attempt: int) -> Path:
    return Path(state_dir) / DIR_NAME / f"a{attempt:04d}-rank_"


def rank_env(state_dir: Path, attempt: int, env: Mapping[str, str]) -> dict[str, str]:
    """The settings that make each rank's NCCL process groups record their collectives and dump them to ftsup's
    directory on a timeout or when asked, each group unless `env` (the ranks' environment so far) sets one of it.
    {} when the directory cannot be made (the capture then says that no dump was found)."""
    try:
        where = statedir.ensure_dir(Path(state_dir) / DIR_NAME, "job.state_dir")
        _prune(where, attempt)
    except (OSError, SupervisorError):
        return {}
    stem = str(prefix(state_dir, attempt))
    wanted = [(BUFFER, BUFFER_ENTRIES), (DUMP_FILE, stem), (PIPE, stem), (ON_TIMEOUT, "1")]
    return {names[0]: value for names, value in wanted if not any(n in env for n in names)}


def _prune(where: Path, attempt: int) -> None:
    for entry in os.scandir(where):
        m = _NAME.fullmatch(entry.name)
        if m and int(m[1]) < attempt - KEEP_ATTEMPTS and not entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


def poke(stem: Path, ranks: Iterable[int]) -> list[int]:
    """Ask each rank's NCCL process group for its dump: a byte into its pipe, a FIFO of ours that the rank holds open
    (torch makes it with the process group). The ranks asked; a rank without a pipe (no NCCL group, or its settings
    are the job's) or without a reader is left alone."""
    asked = []
    for rank in ranks:
        path = f"{stem}{int(rank)}.pipe"
        try:
            st = os.lstat(path)
            if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # none there; ENXIO: no reader (the rank is gone)
            continue
        try:
            os.write(fd, b"1")
            asked.append(int(rank))
        except OSError as e:
            if e.errno != errno.EAGAIN:
                continue
        finally:
            os.close(fd)
    return asked


def collect(
    stem: Path,
    ranks: Iterable[int],
    asked: Iterable[int],
    until: float,
    clock: Callable[[], float],
    store: incidents.Store,
    incident_id: str,
) -> tuple[list[incidents.NcclDump], list[str]]:
    """Copy each rank's dump (`<stem><rank>`: one written on a timeout, or asked for by `poke`) beside the incident
    record; for a rank asked, wait until `until` for its dump to appear and stop growing. (dumps, problems)."""
    dumps: list[incidents.NcclDump] = []
    problems: list[str] = []
    waiting = set(asked)
    sizes: dict[int, int] = {}
    pending = sorted(set(ranks))
    while pending:
        for rank in list(pending):
            src = Path(f"{stem}{rank}")
            try:
                size = os.lstat(src).st_size
            except FileNotFoundError:
                size = -1
            except OSError as e:
                problems.append(f"rank {rank}'s NCCL dump: {e.strerror or e}")
                pending.remove(rank)
                continue
            settled = size >= 0 and sizes.get(rank) == size
            sizes[rank] = size
            if size < 0 and rank not in waiting:
                pending.remove(rank)
            elif settled or (size >= 0 and rank not in waiting) or clock() >= until:
                pending.remove(rank)
                if size < 0:
                    problems.append(f"rank {rank}'s NCCL dump: asked for, not written within the bound")
                    continue
                dst = store.dump_path(incident_id, rank)
                try:
                    copied = incidents.copy_dump(src, dst)
                except OSError as e:
                    problems.append(f"rank {rank}'s NCCL dump: {e.strerror or e}")
                    continue
                dumps.append(incidents.NcclDump(rank, dst.name, copied))
        if pending:
            time.sleep(POLL_S)  # a poll for the files the ranks write, bounded by `until`
    return sorted(dumps, key=lambda d: d.rank), problems
