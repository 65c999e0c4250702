"""Ranks in lockstep without torch: each step is some work, then a wait for every rank to arrive (the all-reduce of a
data-parallel step, through files), then `runtime().beat(step)`; for tests that need many attempts of a job whose
ranks wait for each other, each starting in a fraction of a second.

    lockstep.py --steps N --dir DIR [--step-s S]

Run by torchrun (RANK, WORLD_SIZE). Each rank writes `{"pid", "step", "attempt"}` to DIR/rank-R.json when it arrives
at a step, and waits there until every rank of its attempt has arrived at it too, polling as a blocked collective
sleeps, so that a rank that stops holds the others up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ftsup import runtime

POLL_S = 0.005


def arrived(path: Path, attempt: str) -> int:
    """The step the rank whose file is `path` has arrived at in this attempt (0: none yet)."""
    try:
        seen = json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return 0
    return int(seen["step"]) if seen.get("attempt") == attempt else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--step-s", type=float, default=0.02)
    args = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("FTSUP_ATTEMPT", "0")
    mine = args.dir / f"rank-{rank}.json"
    for step in range(1, args.steps + 1):
        time.sleep(args.step_s)  # the step's own work
        aside = mine.with_suffix(".tmp")
        aside.write_text(json.dumps({"pid": os.getpid(), "step": step, "attempt": attempt}))
        os.replace(aside, mine)
        while any(arrived(args.dir / f"rank-{r}.json", attempt) < step for r in range(world)):
            time.sleep(POLL_S)
        runtime().beat(step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
