"""The supervisor end of the heartbeat channel: a UNIX datagram socket in a private directory.

Ranks send one JSON datagram per beat (see trainer/runtime.py). `HeartbeatReceiver.drain()`
returns every valid beat waiting, never blocking; malformed datagrams are counted and dropped
(a rank cannot crash the supervisor by sending garbage). The directory is created 0700 so that
only this user's processes can talk to the supervisor.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

MAX_DATAGRAM = 65536
PHASES = frozenset({"init", "load", "train", "save", "done"})


@dataclass(frozen=True)
class Beat:
    attempt: int
    rank: int
    local_rank: int
    pid: int
    step: int
    phase: str
    sent_unix: float
    figures: tuple[tuple[str, float], ...] = ()


def parse_beat(raw: bytes) -> Beat | None:
    try:
        m = json.loads(raw)
        beat = Beat(
            attempt=int(m["attempt"]), rank=int(m["rank"]), local_rank=int(m["local_rank"]), pid=int(m["pid"]),
            step=int(m["step"]), phase=str(m["phase"]), sent_unix=float(m["t"]),
            figures=tuple(sorted((k, float(v)) for k, v in m.items()
                                 if k not in {"v", "attempt", "rank", "local_rank", "pid", "step", "phase", "t"}
                                 and isinstance(v, (int, float)) and not isinstance(v, bool))),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError):
        return None
    return beat if beat.phase in PHASES else None


class HeartbeatReceiver:
    def __init__(self, runtime_dir: str | os.PathLike[str]):
        self.dir = Path(runtime_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.path = self.dir / "heartbeat.sock"
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.setblocking(False)
        self.malformed = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> list[Beat]:
        beats: list[Beat] = []
        while True:
            try:
                raw = self.sock.recv(MAX_DATAGRAM)
            except BlockingIOError:
                return beats
            beat = parse_beat(raw)
            if beat is None:
                self.malformed += 1
            else:
                beats.append(beat)

    def close(self) -> None:
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> HeartbeatReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
