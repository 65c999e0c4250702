"""A rank that fails in one way, for tests of how failures are told: imports neither torch nor ftsup.

    failing_rank.py MODE [--rank R] [--after-s S] [--lines N]

Under torchrun (RANK set), rank R prints N numbered lines (`out i` on stdout, `err i` on stderr), waits S seconds,
then fails as MODE says: `exit` raises `ValueError: boom at step 3` (exit status 1, a traceback), `kill` SIGKILLs
itself, `segv` reads address 0 (SIGSEGV), `import` imports a module that does not exist. Every other rank waits,
60 s at most, to be stopped by torchrun.
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
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if rank != args.rank:
        time.sleep(60)
        return 0
    for i in range(args.lines):
        print(f"out {i}", flush=True)
        print(f"err {i}", file=sys.stderr, flush=True)
    time.sleep(args.after_s)
    if args.mode == "exit":
        raise ValueError("boom at step 3")
    if args.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "segv":
        ctypes.string_at(0)
    importlib.import_module("ftsup_no_such_module")
    return 0


if __name__ == "__main__":
    sys.exit(main())
