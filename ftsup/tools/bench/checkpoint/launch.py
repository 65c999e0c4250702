"""Start a group of rank processes, wait for them under one deadline, and leave nothing behind: each rank is
`python -m ftsup.tools.bench.checkpoint.rank SPEC` behind the parent-death guard, in a session of its own so that
what it starts (DCP's checkpoint daemon) is signalled with it, and is stopped by the one stop sequence
(`ftsup.procs.stop`). Torch-free: the parent process of a benchmark never imports torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ftsup import guard, procs

# A rank that exits non-zero leaves its peers blocked in a collective; give them this long
# to notice on their own before they are stopped.
PEER_FAILURE_GRACE_S = 10.0
_TERM_GRACE_S = 3.0
_POLL_S = 0.05


@dataclass(frozen=True)
class RankExit:
    rank: int
    pid: int
    returncode: int | None  # None: it had to be killed; negative: killed by that signal


@dataclass(frozen=True)
class GroupOutcome:
    """How a group of ranks ended: "ok", "failed" (a rank exited non-zero) or "timeout"."""

    status: str
    exits: tuple[RankExit, ...]
    wall_s: float
    stopped_pids: tuple[int, ...]  # processes of the group still running when we stopped it
    leftover_pids: tuple[int, ...]  # processes still alive after the final SIGKILL

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def free_port() -> int:
    """A TCP port the kernel just handed out (bind to port 0), for MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _group_members(pgids: set[int]) -> list[psutil.Process]:
    """The live processes of the process groups `pgids` (a rank and whatever it started, even
    once reparented)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in pgids and procs.alive(p):
                found.append(p)
        except (OSError, psutil.Error):  # gone meanwhile
            continue
    return found


def rank_command(spec_path: Path) -> list[str]:
    """The command line of one benchmark rank."""
    return [sys.executable, "-m", "ftsup.tools.bench.checkpoint.rank", str(spec_path)]


def run_group(
    world_size: int,
    command: list[str],
    log_dir: Path,
    name: str,
    timeout_s: float,
    env_extra: dict[str, str] | None = None,
    peer_failure_grace_s: float = PEER_FAILURE_GRACE_S,
) -> GroupOutcome:
    """Run `command` as `world_size` ranks; return once every process of theirs is gone.

    Each rank gets RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT in its environment
    and writes its output to `log_dir/NAME-rankR.log`.
    """
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    ranks: list[subprocess.Popen[bytes]] = []
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(env_extra or {})
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            with open(log_dir / f"{name}-rank{rank}.log", "wb") as log:
                guarded, guard_env = guard.wrap(command)  # each rank dies with this process
                ranks.append(
                    subprocess.Popen(
                        guarded,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**env, **guard_env},
                        start_new_session=True,
                    )
                )
        status = _wait(ranks, deadline, peer_failure_grace_s)
    finally:
        stopped, leftovers = _stop_all(ranks)
    exits = tuple(
        RankExit(rank, p.pid, p.returncode if p.returncode is not None else None) for rank, p in enumerate(ranks)
    )
    return GroupOutcome(status, exits, time.monotonic() - start, tuple(stopped), tuple(leftovers))


def _wait(ranks: list[subprocess.Popen[bytes]], deadline: float, grace_s: float) -> str:
    first_failure: float | None = None
    while True:
        codes = [p.poll() for p in ranks]
        if all(c is not None for c in codes):
            return "ok" if all(c == 0 for c in codes) else "failed"
        now = time.monotonic()
        if first_failure is None and any(c not in (None, 0) for c in codes):
            first_failure = now
        if first_failure is not None and now - first_failure > grace_s:
            return "failed"
        if now > deadline:
            return "timeout"
        time.sleep(_POLL_S)


def _stop_all(ranks: list[subprocess.Popen[bytes]]) -> tuple[list[int], list[int]]:
    """Stop every process of the ranks' process groups (`procs.stop`), reaping the ranks.

    Returns the pids found running when stopping began, and those still alive at the end.
    """
    pgids = {p.pid for p in ranks}  # start_new_session: each rank leads its own group
    stopped = sorted(p.pid for p in _group_members(pgids))

    def reap() -> None:
        for p in ranks:
            p.poll()

    left = procs.stop(lambda: _group_members(pgids), _TERM_GRACE_S, reap=reap)
    return stopped, left
