"""A short command run for what it says (a health command, `nvidia-smi`): behind the parent-death guard, in a session
of its own, for at most a deadline, keeping at most a cap of what it prints; whatever it started is killed with it.
Its output is hostile input, only ever quoted (docs/design/run-loop.md, Node health).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from ftsup import guard
from ftsup.supervisor.errors import error_line

MAX_BYTES = 64 * 1024  # of each of stdout and stderr kept
QUOTE_CHARS = 200
_READ = 65536
_LINGER_S = 0.2  # once the command exited, how long what it started may still hold its pipes


@dataclass(frozen=True)
class Ran:
    """How a command ended: `code` its exit status (negative: the signal), None when it did not end in time or could
    not start (`why` says which); `out` and `err` at most `MAX_BYTES` each."""

    code: int | None
    out: bytes = b""
    err: bytes = b""
    why: str | None = None

    @property
    def ok(self) -> bool:
        return self.code == 0


def run(
    argv: Sequence[str],
    timeout_s: float,
    *,
    env: Mapping[str, str] | None = None,
    max_bytes: int = MAX_BYTES,
    clock: Callable[[], float] = time.monotonic,
) -> Ran:
    """Run `argv` until it exits or `timeout_s` passes, reading at most `max_bytes` of each stream (the rest is read
    and dropped, so that the command never blocks on a full pipe). At the deadline, or once the command exited and
    what it started still holds its pipes, its whole session is killed: nothing it started outlives the check."""
    wrapped, guard_env = guard.wrap(list(argv))
    try:
        proc = subprocess.Popen(
            wrapped,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**(os.environ if env is None else env), **guard_env},
            start_new_session=True,
        )
    except OSError as e:
        return Ran(None, why=f"cannot start: {error_line(e)}")
    deadline = clock() + timeout_s
    kept: dict[int, bytearray] = {}
    exited_at: float | None = None
    timed_out = False
    with selectors.DefaultSelector() as sel:
        for stream in _streams(proc):
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
            kept[stream.fileno()] = bytearray()
        while sel.get_map():
            now = clock()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and _exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at >= _LINGER_S:
                break  # the command is done; what holds its pipes now is what it started
            for key, _ in sel.select(timeout=min(0.05, max(0.0, deadline - now))):
                chunk = _read(key.fd)
                if chunk is None:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = kept[key.fd]
                buf += chunk[: max(0, max_bytes - len(buf))]
    _kill_session(proc)
    code = proc.wait()
    out, err = (bytes(kept[stream.fileno()]) for stream in _streams(proc))
    for stream in _streams(proc):
        stream.close()
    if timed_out:
        return Ran(None, out, err, why=f"did not finish within {timeout_s:g}s; stopped")
    return Ran(code, out, err)


def _streams(proc: subprocess.Popen[bytes]) -> list[IO[bytes]]:
    return [stream for stream in (proc.stdout, proc.stderr) if stream is not None]


def _read(fd: int) -> bytes | None:
    """What the pipe holds now; b"" at its end (or an error), None when nothing is there yet."""
    try:
        return os.read(fd, _READ)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _exited(pid: int) -> bool:
    """Whether the command exited, leaving it unreaped: its pid, and so its session's id, stays ours until `wait`."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the session the command leads (created for it, its id its unreaped pid: never anyone else's)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def quote(data: bytes, limit: int = QUOTE_CHARS) -> str:
    """The first non-empty line of `data` as a message may show it: decoded with replacement, control characters
    dropped, cut to `limit` characters, in quotes."""
    text = data[: limit * 8].decode("utf-8", "replace")
    lines = ("".join(ch for ch in ln if ch.isprintable()).strip() for ln in text.splitlines())
    line = next((ln for ln in lines if ln), "")
    cut = line[:limit] + ("..." if len(line) > limit else "")
    return f'"{cut}"'
