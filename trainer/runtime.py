"""The rank side of the supervisor channel: heartbeats out, save/stop requests in.

    from trainer.runtime import runtime
    rt = runtime()                         # reads the environment once; a no-op without a supervisor
    with rt.phase("load", step=0): state.resume(engine)
    for step in ...:
        ...
        rt.beat(step, loss=loss, step_time_s=dt)

Heartbeats are fire-and-forget datagrams on a UNIX socket whose path the supervisor exports
(`FTSUP_HEARTBEAT_SOCKET`). Sending never blocks and never raises: a full queue or a missing
supervisor drops the beat (counted in `dropped`). A rank never outlives its torchrun agent
(torchrun starts ranks in sessions of their own, where signals to the agent's process group do
not reach them): `ftsup run` starts each rank behind a parent-death guard armed before exec,
and a rank started some other way arms it when the client is created.

Requests come the other way through a small JSON file the supervisor replaces atomically
(`FTSUP_CONTROL_FILE`): `{"seq": n, "action": "save", "stop": bool, "reason": ..., "deadline_unix": ...}`.
A rank checks it once per step with one `stat()`; then all ranks agree on it with one tiny
all-reduce (MAX), so that a notice seen by one node's supervisor reaches every rank of the job
at the same step (`agree`).

This module is the one place where the trainer reads `FTSUP_*` environment variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from supervisor import guard

PHASES = ("init", "load", "train", "save", "done")


@dataclass(frozen=True)
class RuntimeEnv:
    heartbeat_socket: str | None = None
    control_file: str | None = None
    checkpoint_dir: str | None = None
    resume_step: int | None = None
    attempt: int = 0
    run_id: str | None = None
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> RuntimeEnv:
        env = os.environ if env is None else env

        def num(key: str, default: int | None) -> int | None:
            raw = env.get(key, "").strip()
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None

        return cls(
            heartbeat_socket=env.get("FTSUP_HEARTBEAT_SOCKET") or None,
            control_file=env.get("FTSUP_CONTROL_FILE") or None,
            checkpoint_dir=env.get("FTSUP_CHECKPOINT_DIR") or None,
            resume_step=num("FTSUP_RESUME_STEP", None),
            attempt=num("FTSUP_ATTEMPT", 0) or 0,
            run_id=env.get("FTSUP_RUN_ID") or None,
            rank=num("RANK", 0) or 0,
            local_rank=num("LOCAL_RANK", 0) or 0,
            world_size=num("WORLD_SIZE", 1) or 1,
        )


class RuntimeClient:
    def __init__(self, env: RuntimeEnv, *, clock=time.time):  # type: ignore[no-untyped-def]
        self.env = env
        self._clock = clock
        self._sock: socket.socket | None = None
        self._phase = "init"
        self._step = env.resume_step or 0
        self.sent = 0
        self.dropped = 0
        self.control = ControlReader(env.control_file)
        if env.heartbeat_socket:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            _arm_parent_death_signal()

    @property
    def supervised(self) -> bool:
        return self._sock is not None

    def beat(self, step: int, phase: str | None = None, **figures: float | int | str) -> None:
        """Report `step` (optimizer steps completed) and the phase; never blocks, never raises."""
        if phase is not None:
            self._phase = phase
        self._step = step
        if self._sock is None or self.env.heartbeat_socket is None:
            return
        msg = {
            "v": 1, "attempt": self.env.attempt, "rank": self.env.rank, "local_rank": self.env.local_rank,
            "pid": os.getpid(), "step": step, "phase": self._phase, "t": self._clock(),
        }  # fmt: skip
        msg.update(figures)
        try:
            self._sock.sendto(json.dumps(msg).encode(), self.env.heartbeat_socket)
            self.sent += 1
        except OSError:  # no supervisor listening, or its queue is full: drop, never stall training
            self.dropped += 1

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Mark a long phase (load, save) so that the supervisor applies its longer timeout."""
        before = self._phase
        self.beat(self._step if step is None else step, name)
        try:
            yield
        finally:
            self.beat(self._step, before)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


@dataclass(frozen=True)
class Request:
    seq: int
    stop: bool = False
    reason: str = ""
    deadline_unix: float | None = None

    @property
    def pending(self) -> bool:
        return self.seq > 0


NO_REQUEST = Request(0)


class ControlReader:
    """Reads the supervisor's control file when it changes (one stat() per call otherwise)."""

    def __init__(self, path: str | None):
        self.path = path
        self._sig: tuple[int, int, int] | None = None
        self._last = NO_REQUEST

    def poll(self) -> Request:
        if not self.path:
            return NO_REQUEST
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self._last
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig != self._sig:
            self._sig = sig
            try:
                with open(self.path) as f:
                    obj = json.load(f)
                self._last = Request(
                    int(obj["seq"]), bool(obj.get("stop", False)), str(obj.get("reason", "")), obj.get("deadline_unix")
                )
            except (OSError, ValueError, KeyError, TypeError):
                self._sig = None  # a torn or odd file: read it again next step
        return self._last


def agree(request: Request, device: Any = "cpu") -> Request:
    """All ranks of the job agree on the newest request (one all-reduce of two integers, MAX).

    Must be called by every rank at the same point of every step. Without torch.distributed it
    returns `request` as is. The agreed request carries the highest seq and whether any rank's
    supervisor asked to stop; reason and deadline are this rank's own copy (may be empty).
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return request
    t = torch.tensor([request.seq, int(request.stop)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    seq, stop = (int(x) for x in t.tolist())
    if seq == request.seq:
        return Request(seq, bool(stop), request.reason, request.deadline_unix)
    return Request(seq, bool(stop), "requested on another node", None)


def _arm_parent_death_signal() -> None:
    """SIGKILL this rank when its parent dies. A rank that `ftsup run` started through its exec
    wrapper has the guard armed since before its first import; any other (the training command
    started by a shell script, say) arms it here, best effort (`supervisor.guard`)."""
    guard.arm_in_process()


_client: RuntimeClient | None = None


def runtime() -> RuntimeClient:
    """The process's client (created on first use from the environment)."""
    global _client
    if _client is None:
        _client = RuntimeClient(RuntimeEnv.from_environ())
    return _client
