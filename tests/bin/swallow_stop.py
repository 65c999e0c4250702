"""A tracer that swallows one SIGSTOP, as a stack capture attaching at the wrong moment does: it starts `sleep` as
its child, seizes it with ptrace, prints the child's pid, waits for the child's next signal-delivery stop and
detaches without delivering that signal. It prints what it swallowed, then waits for its stdin to close, kills the
child and reaps it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    child = subprocess.Popen(["sleep", "600"])
    if libc.ptrace(PTRACE_SEIZE, child.pid, None, None) != 0:
        sys.exit(f"PTRACE_SEIZE: {os.strerror(ctypes.get_errno())}")
    print(child.pid, flush=True)
    _, status = os.waitpid(child.pid, 0)
    got = os.WSTOPSIG(status) if os.WIFSTOPPED(status) else -1
    if libc.ptrace(PTRACE_DETACH, child.pid, None, None) != 0:  # data 0: the stop's signal is not delivered
        sys.exit(f"PTRACE_DETACH: {os.strerror(ctypes.get_errno())}")
    print(f"swallowed {signal.Signals(got).name if got > 0 else got}", flush=True)
    sys.stdin.read()
    child.kill()
    child.wait()


if __name__ == "__main__":
    main()
