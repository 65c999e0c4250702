"""The parent-death guard: the one place that sets `PR_SET_PDEATHSIG` (Linux), before exec (`wrap`) or in process.

Stdlib only, importing nothing of ftsup: the wrapper runs isolated (`-I -S`) under any interpreter
(docs/design/process-and-protocol.md, The parent-death guard). Not here: stopping processes (`ftsup.procs`).
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
