"""A rank that fails in one way, for tests of how failures are told: imports no torch (nor ftsup, unless --beat).

    failing_rank.py MODE [--rank R] [--after-s S] [--lines N] [--beat]

Under torchrun (RANK set), rank R prints N numbered lines (`out i` on stdout, `err i` on stderr), waits S seconds,
then fails as MODE says: `exit` raises `ValueError: boom at step 3` (exit status 1, a traceback), `kill` SIGKILLs
itself, `segv` reads address 0 (SIGSEGV), `import` imports a module that does not exist. Every other rank waits,
60 s at most, to be stopped by torchrun. With --beat every rank sends a heartbeat of a new training step every
0.05 s while it waits, as a supervised training script does (so the supervisor knows its ranks' pids).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import signal
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["exit", "kill", "segv", "import"])
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--after-s", type=float, default=0.5)
    p.add_argument("--lines", type=int, default=3)
    p.add_argument("--beat", action="store_true")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if rank == args.rank:
        for i in range(args.lines):
            print(f"out {i}", flush=True)
            print(f"err {i}", file=sys.stderr, flush=True)
    wait(args.after_s if rank == args.rank else 60.0, beat=args.beat)
    if rank != args.rank:
        return 0
    if args.mode == "exit":
        raise ValueError("boom at step 3")
    if args.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "segv":
        ctypes.string_at(0)
    importlib.import_module("ftsup_no_such_module")
    return 0


def wait(seconds: float, *, beat: bool) -> None:
    if not beat:
        time.sleep(seconds)
        return
    from ftsup.trainer.runtime import runtime

    rt = runtime()
    deadline, step = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        step += 1
        rt.beat(step, "train", loss=1.0 / step)
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
