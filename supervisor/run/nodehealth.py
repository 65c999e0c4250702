"""This node's checks before each attempt: the user's `launch.health_command`, NVIDIA GPUs through `nvidia-smi`, free
disk where the checkpoints and the state directory live, free memory. Each says ok, failed, unknown (it could not
look: never taken for a pass) or skipped (docs/design/run-loop.md, Node health).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ftsup.supervisor.config.job import JobConfig
from ftsup.supervisor.errors import error_line
from ftsup.supervisor.policy.nodes import Check, Verdict, verdict
from ftsup.supervisor.run import capped

MEMINFO = Path("/proc/meminfo")
MAX_MEMINFO_BYTES = 64 * 1024
NVIDIA_QUERY = ("--query-gpu=index,name", "--format=csv,noheader")


def gib(n: int) -> str:
    """A size as the checks say it: GiB, or MiB below one GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check(
    cfg: JobConfig,
    command: capped.Ran | None,
    *,
    meminfo: Path = MEMINFO,
    which: Callable[[str], str | None] = shutil.which,
    dev: Path = Path("/dev"),
) -> Verdict:
    """Every check of this node, in `nodes.CHECKS` order; `command` is how `launch.health_command` ran (None: none
    is configured), run once by the caller for this check and the slot count both."""
    ln = cfg.launch
    return verdict(
        [
            command_check(command),
            gpus(ln.health_timeout_s, which=which, dev=dev),
            disk("disk_checkpoint", Path(cfg.checkpoint.dir), ln.min_free_disk_bytes),
            disk("disk_state", Path(cfg.job.state_dir), ln.min_free_disk_bytes),
            memory(ln.min_free_memory_bytes, meminfo),
        ]
    )


def command_check(ran: capped.Ran | None) -> Check:
    """The user's command: passed when it exits 0; its first line of output (stderr, else stdout) is quoted when it
    does not."""
    if ran is None:
        return Check("command", "skipped", "no launch.health_command")
    if ran.code is None:
        return Check("command", "failed", ran.why or "did not finish")
    if ran.code != 0:
        said = capped.quote(ran.err) if ran.err.strip() else capped.quote(ran.out)
        return Check("command", "failed", f"exited {ran.code}: {said}")
    return Check("command", "ok")


def gpus(timeout_s: float, *, which: Callable[[str], str | None] = shutil.which, dev: Path = Path("/dev")) -> Check:
    """NVIDIA GPUs visible and answering through `nvidia-smi` (NVML's command line). No `nvidia-smi` and no NVIDIA
    device: nothing to check; devices without `nvidia-smi`: unknown (they cannot be asked)."""
    exe = which("nvidia-smi")
    if exe is None:
        if any(dev.glob("nvidia[0-9]*")):
            return Check("gpus", "unknown", f"NVIDIA devices in {dev} but no nvidia-smi to ask them")
        return Check("gpus", "skipped", "no NVIDIA GPU here")
    ran = capped.run([exe, *NVIDIA_QUERY], timeout_s)
    if ran.code is None:
        return Check("gpus", "failed", f"nvidia-smi {ran.why}")
    if ran.code != 0:
        return Check("gpus", "failed", f"nvidia-smi exited {ran.code}: {capped.quote(ran.out + ran.err)}")
    listed = [line for line in ran.out.decode("utf-8", "replace").splitlines() if line.strip()]
    if not listed:
        return Check("gpus", "failed", "nvidia-smi lists no GPU")
    return Check("gpus", "ok", f"{len(listed)} GPU(s)")


def disk(name: str, path: Path, min_bytes: int) -> Check:
    """Free space on the filesystem of `path` (of its nearest existing directory, before it is made)."""
    if min_bytes <= 0:
        return Check(name, "skipped", "min_free_disk_bytes is 0")
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError as e:
        return Check(name, "unknown", f"cannot look at {where}: {error_line(e)}")
    free = st.f_bavail * st.f_frsize
    if free < min_bytes:
        return Check(name, "failed", f"{gib(free)} free in {path}, below {gib(min_bytes)}")
    return Check(name, "ok", f"{gib(free)} free")


def memory(min_bytes: int, meminfo: Path = MEMINFO) -> Check:
    """`MemAvailable` of /proc/meminfo (the kernel's estimate of what can be allocated without swapping)."""
    if min_bytes <= 0:
        return Check("memory", "skipped", "min_free_memory_bytes is 0")
    try:
        with open(meminfo, "rb") as f:
            text = f.read(MAX_MEMINFO_BYTES).decode("ascii", "replace")
    except OSError as e:
        return Check("memory", "unknown", f"cannot read {meminfo}: {error_line(e)}")
    for line in text.splitlines():
        key, _, value = line.partition(":")
        words = value.split()
        if key == "MemAvailable" and len(words) == 2 and words[0].isdigit() and words[1] == "kB":
            available = int(words[0]) * 1024
            if available < min_bytes:
                return Check("memory", "failed", f"{gib(available)} available, below {gib(min_bytes)}")
            return Check("memory", "ok", f"{gib(available)} available")
    return Check("memory", "unknown", f"no MemAvailable in {meminfo}")
