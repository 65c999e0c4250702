"""A rank that beats like a healthy trainer and, between its beats, sends the supervisor's
heartbeat socket what a hostile or broken process would: odd ranks, local ranks and attempts,
a rank it is not, a step no rank could have reached, thousands of distinct figure names, odd
phases, huge and non-finite values, malformed JSON.

    hostile_rank.py PROGRESS FINISH

Counts the hostile bursts it has sent in PROGRESS (rewritten after each); exits 0, after a
"done" beat, once FINISH exists. No torch: it starts in well under a second. Real beats go
through the runtime client; each hostile message goes on a connection of its own (the
supervisor hangs up on a peer after one bad message), from this process, which is part of
the attempt (so the messages reach the supervisor's checks instead of being refused at once).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from ftsup.protocol import BEAT_VERSION
from ftsup.trainer.runtime import runtime

BURST = 40  # hostile messages between two real beats


def hostile(i: int, attempt: int, pid: int) -> list[bytes]:
    base = {
        "v": BEAT_VERSION,
        "attempt": attempt,
        "rank": 0,
        "local_rank": 0,
        "pid": pid,
        "step": 1,
        "phase": "train",
        "t": time.time(),
        "mono": time.monotonic(),
    }
    odd: list[dict[str, object]] = [
        {**base, "rank": 10**6 + i, "local_rank": 10**6 + i},
        {**base, "rank": -1 - i, "local_rank": -1},
        {**base, "rank": 2**62, "local_rank": 2**62},
        {**base, "attempt": 10**9 + i},
        {**base, "rank": 5, "local_rank": 5},  # a rank of a larger job, from this rank's own pid
        {**base, "step": 10**12},  # further ahead than a step can be
        {**base, f"figure_{i}": 1.0, f'Ünïcode "name" {{{i}}}': 2.0, f"loss{i}": 3.0},
        {**base, "phase": f"phase-{i}"},
        {**base, "loss": 1e308, "save_s": -1e308, "saved_step": 2**70 + i},
        {**base, "rank": str(i), "step": f"{i}"},
    ]
    out = [json.dumps(m).encode() for m in odd]
    out += [b"{not json " + str(i).encode(), b'{"v": 2, "attempt": NaN, "step": Infinity}', b"[" * 500]
    return out


def send_alone(path: str, raw: bytes) -> None:
    """One message on a connection of its own; refused or dropped is fine (the supervisor's choice)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK) as s:
        try:
            s.connect(path)
            s.send(raw)
        except OSError:
            time.sleep(0.001)  # its backlog or our queue is full: let the supervisor drain it


def main() -> int:
    progress, finish = Path(sys.argv[1]), Path(sys.argv[2])
    path = os.environ["FTSUP_HEARTBEAT_SOCKET"]
    attempt = int(os.environ["FTSUP_ATTEMPT"])
    rt = runtime()
    step = 0
    bursts = 0
    while not finish.exists():
        step += 1
        rt.beat(step, "train", loss=2.0)
        sent = 0
        while sent < BURST:
            for raw in hostile(bursts * BURST + sent, attempt, os.getpid()):
                send_alone(path, raw)
                sent += 1
        bursts += 1
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(str(bursts))
        os.replace(tmp, progress)
        time.sleep(0.05)  # a step's worth of time
    rt.beat(step, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
