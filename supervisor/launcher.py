"""Start one attempt under torchrun, and stop it so that nothing of it survives.

- `torchrun_argv` builds the command (pure): `--max-restarts=0` (restarts are the
  supervisor's decision), `--nnodes`, `--nproc-per-node`, c10d rendezvous (or `--standalone`
  for one node without an endpoint), then the training command.
- `Attempt.start` runs it in a session of its own with a parent-death signal (so torchrun dies
  with the supervisor, and the ranks, which arm their own guard, die with torchrun), output to a
  per-attempt log file.
- `Attempt.stop` walks the process tree (torchrun starts ranks in sessions of their own, so a
  signal to its process group would not reach them): SIGTERM (and SIGCONT, so that a stopped
  rank can act on it), one grace deadline, SIGKILL, and a check that no process is left.

Not here: when to start or stop (policy), what to export beyond the attempt's environment.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]  # the training command, e.g. (python, -m, trainer.examples.gpt, ...)
    nproc: int
    nnodes: str = "1"  # "N" or "MIN:MAX"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "ftsup"
    rdzv_conf: str | None = None
    extra_args: tuple[str, ...] = ()
    python: str | None = None  # interpreter that runs torchrun (default: the command's python)


def _is_python(exe: str) -> bool:
    return Path(exe).name.startswith("python")


def torchrun_argv(spec: LaunchSpec) -> list[str]:
    """The full argv: `<python> -m torch.distributed.run <torchrun options> <training command>`."""
    cmd = list(spec.command)
    python = spec.python or (cmd[0] if cmd and _is_python(cmd[0]) else "python3")
    argv = [python, "-m", "torch.distributed.run", f"--nnodes={spec.nnodes}", f"--nproc-per-node={spec.nproc}",
            "--max-restarts=0", "--monitor-interval=0.1"]  # fmt: skip
    if spec.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id}"]
        if spec.rdzv_conf:
            argv.append(f"--rdzv-conf={spec.rdzv_conf}")
    else:
        argv.append("--standalone")
    argv += list(spec.extra_args)
    if cmd and _is_python(cmd[0]):
        rest = cmd[1:]
        if rest[:1] == ["-m"]:
            argv += ["-m", *rest[1:]]
        else:
            argv += rest
    else:
        argv += ["--no-python", *cmd]
    return argv


def _child_setup(ignore: tuple[int, ...]) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # Notice signals are the supervisor's. Slurm delivers a step's signals to every process
        # in it, and SIGUSR1's default action would kill torchrun and the ranks before they could
        # save; an ignored disposition survives exec, so the whole tree ignores them.
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)

    return setup


@dataclass
class RunningAttempt:
    number: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    known_pids: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def rank_pids(self) -> frozenset[int]:
        """torchrun's direct children: the rank processes of the current worker group."""
        try:
            return frozenset(c.pid for c in psutil.Process(self.proc.pid).children() if _alive(c))
        except psutil.NoSuchProcess:
            return frozenset()

    def tree(self) -> list[psutil.Process]:
        """torchrun and every descendant still alive, plus ranks we learned of by heartbeat."""
        procs: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.proc.pid)
            procs[root.pid] = root
            for c in root.children(recursive=True):
                procs[c.pid] = c
        except psutil.NoSuchProcess:
            pass
        for pid in self.known_pids - procs.keys():  # a rank reparented after torchrun died
            try:
                p = psutil.Process(pid)
                if p.create_time() >= self.started_at - 1:  # not a recycled pid of an older process
                    procs[pid] = p
            except psutil.NoSuchProcess:
                pass
        return [p for p in procs.values() if _alive(p)]

    def stop(self, grace_s: float, *, clock: Callable[[], float] = time.monotonic) -> list[int]:
        """SIGTERM the whole tree, wait `grace_s`, SIGKILL what is left; return pids that survived."""
        procs = self.tree()
        signal_all(procs, signal.SIGTERM)
        signal_all(procs, signal.SIGCONT)  # a SIGSTOPped rank acts on SIGTERM only once continued
        deadline = clock() + grace_s
        while clock() < deadline:
            self.proc.poll()
            procs = [p for p in procs if _alive(p)] + [p for p in self.tree() if p not in procs]
            if not procs:
                break
            psutil.wait_procs(procs, timeout=min(0.1, max(0.0, deadline - clock())))
        left = self.tree() + [p for p in procs if _alive(p)]
        signal_all(left, signal.SIGKILL)
        psutil.wait_procs(left, timeout=5)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return [p.pid for p in left if _alive(p)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pid_alive(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def signal_all(procs: Sequence[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def start(
    number: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    log_path: Path,
    ignore_signals: tuple[int, ...] = (),
) -> RunningAttempt:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_child_setup(ignore_signals),
        )  # fmt: skip
    return RunningAttempt(number, proc, log_path, time.time())


def kill_leftovers(pids: Sequence[int], *, started_before: float | None = None, grace_s: float = 5.0) -> list[int]:
    """Stop processes of an attempt a previous supervisor left behind (from its journal).

    A pid is only touched if it still exists and was created before `started_before` (the
    journal's record time), so that a recycled pid of an unrelated process is left alone.
    Returns the pids that were signalled.
    """
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if started_before is not None and p.create_time() > started_before + 1:
                continue
            procs.append(p)
            procs.extend(p.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    procs = [p for p in {p.pid: p for p in procs}.values() if _alive(p)]
    signal_all(procs, signal.SIGTERM)
    signal_all(procs, signal.SIGCONT)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    signal_all(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in procs]
