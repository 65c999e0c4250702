"""Run real torchrun jobs and plain subprocesses from tests, and never leave one behind.

torchrun starts each rank in a session of its own, so killing torchrun's process group does
not reach the ranks: on timeout we walk the process tree with psutil.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ftsup import procs

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / "tests" / "bin"
SITE = REPO / "tests" / "site"  # the suite's start-up hook, in every process the tests start
PYTHONPATH = os.pathsep.join([str(REPO), str(SITE)])


T = TypeVar("T")


def wait_for(
    what: Callable[[], T | None], timeout_s: float, message: str | Callable[[], str], poll_s: float = 0.05
) -> T:
    """Poll `what()` until it returns something truthy (returned) or `timeout_s` passes (fail with
    `message`, which may be a callable so that it shows the state at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(poll_s)  # a poll interval under a deadline, not a wait for something to happen
    raise AssertionError(message() if callable(message) else message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Finished:
    returncode: int
    output: str


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it, and wait until they are gone (`ftsup.procs`)."""
    procs.stop(lambda: procs.descendants([pid]), 0)


def run(argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = REPO) -> Finished:
    full_env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"{argv} timed out after {timeout}s; output:\n{out[-4000:]}") from None
    finally:
        kill_tree(proc.pid)
    return Finished(proc.returncode, out)


def torchrun(script: str, args: list[str], *, nproc: int, timeout: float = 120) -> Finished:
    """`torchrun --standalone` (a free rendezvous port on localhost) running tests/bin/<script>."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run([*launcher, "--max-restarts=0", str(BIN / script), *args], timeout=timeout)


def python(script: str, args: list[str], *, timeout: float = 120) -> Finished:
    return run([sys.executable, str(BIN / script), *args], timeout=timeout)
