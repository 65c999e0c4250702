"""The parent-death guard: the one place that sets `PR_SET_PDEATHSIG` (Linux).

A guarded process gets SIGKILL when the thread that started it dies, so nothing of a job
outlives the process that launched it. Two ways in:

- **Before exec** (`wrap`): a process is started as `python -I -S guard.py CMD ARGS...`. The
  guard arms the signal, then checks that its parent is still the process named in
  `FTSUP_GUARD_PARENT` (a launcher that died before the guard was armed has left its child to a
  reaper, which this check catches), sets the dispositions named in `FTSUP_GUARD_IGNORE` to
  SIG_IGN, names itself in `FTSUP_GUARD_PARENT` for the next guard down, and execs CMD. The
  signal and the ignored dispositions survive execve, so CMD is guarded from its first
  instruction, before any heavy import, and `subprocess` needs no `preexec_fn` (which is unsafe
  in a process with threads).
- **In process** (`arm_in_process`): a process that was not started through the guard arms it
  for itself, best effort (the parent it checks against is the one it sees first).

Stdlib only, importing nothing of ftsup: the wrapper runs isolated (`-I -S`) under any
interpreter. Not here: stopping processes (`ftsup.procs`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterable, Sequence

PARENT_ENV = "FTSUP_GUARD_PARENT"  # the pid the next guarded process must have as its parent
IGNORE_ENV = "FTSUP_GUARD_IGNORE"  # comma-separated signal numbers set to SIG_IGN before exec
_PR_SET_PDEATHSIG = 1
_EXIT_NOT_FOUND = 127  # what a shell returns for a command it cannot run


def arm(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Arm the parent-death signal; return whether the parent is still alive afterwards: still
    `expected_parent`, or (None) still the parent seen before arming."""
    parent = os.getppid() if expected_parent is None else expected_parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return os.getppid() == parent


def _die() -> None:
    """What the parent-death signal would have done, had it been armed in time."""
    os.kill(os.getpid(), signal.SIGKILL)


def armed_before_exec() -> bool:
    """Whether this process was started through the wrapper (it is the pid the guard named)."""
    return os.environ.get(PARENT_ENV) == str(os.getpid())


def arm_in_process() -> None:
    """Arm the guard in a running process unless the wrapper did it before exec; die at once
    when the parent is already gone. Best effort: does nothing where prctl is missing."""
    if armed_before_exec():
        return
    try:
        alive = arm()
    except (OSError, AttributeError):
        return
    if not alive:
        _die()


def wrap(
    argv: Sequence[str], *, ignore: Iterable[int] = (), python: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The argv that runs `argv` under the guard, and the environment variables it needs
    (add them to the child's environment). The child dies with the calling thread."""
    env = {PARENT_ENV: str(os.getpid()), IGNORE_ENV: ",".join(str(int(s)) for s in ignore)}
    return command(argv, python=python), env


def command(argv: Sequence[str], *, python: str | None = None) -> list[str]:
    """`argv` behind the wrapper, without the environment: for a launcher (torchrun) that
    starts it from a process already guarded (which names itself in `FTSUP_GUARD_PARENT`)."""
    return [python or sys.executable, "-I", "-S", os.path.abspath(__file__), *argv]


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("guard: usage: guard.py CMD [ARGS...]", file=sys.stderr)
        return 2
    try:
        expected = int(os.environ[PARENT_ENV])
        ignore = [int(s) for s in os.environ.get(IGNORE_ENV, "").split(",") if s]
    except (KeyError, ValueError):
        print(f"guard: {PARENT_ENV} must name the launching pid", file=sys.stderr)
        return 2
    if not arm(expected):
        _die()
    try:
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)
    except (ValueError, OSError) as e:
        print(f"guard: cannot ignore signal {sig}: {e}", file=sys.stderr)
        return 2
    os.environ[PARENT_ENV] = str(os.getpid())  # exec keeps the pid: CMD is the next guard's parent
    try:
        os.execvp(argv[0], list(argv))
    except OSError as e:
        print(f"guard: cannot run {argv[0]!r}: {e.strerror or e}", file=sys.stderr)
    return _EXIT_NOT_FOUND


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
