"""Holds a rank at interpreter start-up, before its training command runs, for tests that kill
processes at that moment (tests/integration/test_orphans.py). Python imports `sitecustomize`
from the first directory of PYTHONPATH that holds one; a test puts this directory there.

With FTSUP_TEST_HOLD=DIR, a process that torchrun started (LOCAL_RANK is set) imports torch
first when FTSUP_TEST_HOLD_AFTER=torch, writes DIR/<pid>.held, then waits (at most 120 s) for
DIR/release. Every other process (torchrun itself, the supervisor) is not affected.
"""

import os
import time

_dir = os.environ.get("FTSUP_TEST_HOLD")
if _dir and "LOCAL_RANK" in os.environ:
    if os.environ.get("FTSUP_TEST_HOLD_AFTER") == "torch":
        import torch  # noqa: F401
    with open(os.path.join(_dir, f"{os.getpid()}.held"), "w"):
        pass
    _deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(_dir, "release")) and time.monotonic() < _deadline:
        time.sleep(0.01)
