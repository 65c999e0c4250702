"""A rank that only beats: steps of --step-s seconds, no torch, for tests of the heartbeat channel.

    beater.py --steps N [--step-s S] [--until FILE] [--eval-at STEP --eval-s S]
              [--stop-at STEP --stop-mark FILE] [--flood-at STEP --flood-s S --flood-out FILE] [--forge-at STEP]

Runs under `ftsup run` (torchrun sets RANK, the supervisor FTSUP_*). --until keeps stepping
past --steps until FILE exists. --eval-at spends --eval-s seconds in phase eval at that step.
In attempt 1 only: --stop-at makes rank 0 write the wall time to --stop-mark and SIGSTOP itself
(a hang) at that step; --flood-at makes the last rank start a child process (so, a process of
the attempt) that floods the heartbeat socket with malformed messages for --flood-s seconds and
writes what the kernel took to --flood-out as JSON. `beater.py flood PATH SECONDS OUT` is that child.
--forge-at makes rank 0 send, from its own pid and each on a connection of its own, a beat claiming rank 5 (local
rank 5) and a beat claiming step 10**12, at that step (a forger inside the attempt).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ftsup.protocol import Phase, encode_beat
from ftsup.trainer.runtime import runtime

GARBAGE = (b"", b"{" * 500, b"[" * 4000, b'{"v": 2, "step": Infinity}', b"\xff" * 64, b'{"v": 1}', b"9" * 400)


def flood(path: str, seconds: float, out: str) -> int:
    """Send malformed messages as fast as possible for `seconds`, reconnecting whenever the
    supervisor hangs up; also try datagrams. Writes counts of what the kernel took and refused."""
    counts = {"sent": 0, "refused": 0, "connects": 0, "datagrams_refused": 0}
    deadline = time.monotonic() + seconds
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock: socket.socket | None = None
    i = 0
    while time.monotonic() < deadline:
        i += 1
        if i % 8 == 0:
            try:
                dgram.sendto(GARBAGE[i % len(GARBAGE)], path)
            except OSError:
                counts["datagrams_refused"] += 1
            continue
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
            try:
                sock.connect(path)
                counts["connects"] += 1
            except OSError:
                counts["refused"] += 1
                sock.close()
                sock = None
                continue
        try:
            sock.send(GARBAGE[i % len(GARBAGE)], socket.MSG_NOSIGNAL)
            counts["sent"] += 1
        except OSError:
            counts["refused"] += 1
            sock.close()
            sock = None
    Path(out).write_text(json.dumps({**counts, "seconds": seconds}))
    return 0


def forge(path: str, attempt: int, step: int) -> None:
    """Two beats no rank of this job could send: rank 5 of a job of fewer ranks, and step 10**12."""
    for rank, claimed in ((5, step), (0, 10**12)):
        raw = encode_beat(
            attempt=attempt,
            rank=rank,
            local_rank=rank,
            pid=os.getpid(),
            step=claimed,
            phase=Phase.TRAIN,
            t=time.time(),
            mono=time.monotonic(),
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(path)
            s.send(raw)


def main(argv: list[str]) -> int:
    if argv[:1] == ["flood"]:
        return flood(argv[1], float(argv[2]), argv[3])
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--until", default=None)
    p.add_argument("--eval-at", type=int, default=-1)
    p.add_argument("--eval-s", type=float, default=0.0)
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--flood-at", type=int, default=-1)
    p.add_argument("--flood-s", type=float, default=0.0)
    p.add_argument("--flood-out", default=os.devnull)
    p.add_argument("--stop-mark", default=os.devnull)
    p.add_argument("--forge-at", type=int, default=-1)
    args = p.parse_args(argv)
    rt = runtime()
    rank, last = rt.env.rank, rt.env.world_size - 1
    first = rt.env.attempt <= 1
    step = rt.env.resume_step or 0
    rt.beat(step, "init")
    flooder = None
    while step < args.steps or (args.until and not Path(args.until).exists()):
        time.sleep(args.step_s)
        step += 1
        rt.beat(step, "train", loss=1.0 / step)
        if step == args.eval_at:
            with rt.phase("eval"):
                time.sleep(args.eval_s)
        if step == args.flood_at and rank == last and first:
            flooder = subprocess.Popen(
                [sys.executable, __file__, "flood", rt.env.heartbeat_socket or "", str(args.flood_s), args.flood_out]
            )
        if step == args.forge_at and rank == 0 and first:
            forge(rt.env.heartbeat_socket or "", rt.env.attempt, step)
        if step == args.stop_at and rank == 0 and first:
            Path(args.stop_mark).write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
    if flooder is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            flooder.wait(timeout=args.flood_s + 30)
    rt.beat(step, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
