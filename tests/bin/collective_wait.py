"""A script without a line of ftsup whose rank 0 waits in an all-reduce that rank 1 never joins (rank 1 sleeps): with
no timeout given to `init_process_group`, torch's own default would keep rank 0 there for half an hour.

    collective_wait.py SECONDS    (how long rank 1 sleeps)
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(float(sys.argv[1]))
        return
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        print(f"all_reduce failed after {time.monotonic() - started:.1f} s: {e}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
