"""A spare torchrun agent, started while an attempt trains, so that the next attempt does not wait for its imports.

A spare can make a launch faster but never make one fail (docs/design/run-loop.md, The spare agent).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ftsup import guard, procs, warmrun
from ftsup.supervisor import statedir
from ftsup.supervisor.run import launcher

MODULE = "torch.distributed.run"
SEND_TIMEOUT_S = 5.0  # a spare still importing takes the message when it is done; one stuck that long is not used
_STOP_WAIT_S = 5.0


@dataclass
class Spare:
    number: int  # the attempt it is parked for
    python: str
    mark: procs.Mark
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    guard_env: dict[str, str]  # the guard's variables as its exec left them: this process, the next guard's parent
    started_at: float  # wall clock, just before it was started

    def alive(self) -> bool:
        return self.proc.poll() is None

    def go(self, launch: launcher.Launch) -> launcher.RunningAttempt | None:
        """Start the attempt `launch` in this spare; None (and the spare stopped) when it cannot be: the caller then
        starts the attempt cold. Either way the spare is spent. Raises OSError only for the log file, as a cold start
        would."""
        head = [self.python, "-m", MODULE]
        argv = launch.argv
        if launch.number != self.number or launch.mark != self.mark or list(argv[:3]) != head or not self.alive():
            self.discard()
            return None
        env = launch.environ(self.guard_env)
        body = json.dumps({"argv": list(argv[3:]), "env": env, "cwd": os.fspath(launch.cwd)}).encode()
        try:
            out = statedir.open_append(launch.log_path)
        except OSError:
            self.discard()
            raise
        with out:
            # Its session back at the usual priority before it is asked: one left at +19 beside busy cores may wait
            # many seconds for the CPU it needs to set itself back.
            with contextlib.suppress(OSError):
                warmrun.set_session_nice(0, self.proc.pid)
            try:
                self.sock.settimeout(SEND_TIMEOUT_S)
                socket.send_fds(self.sock, [warmrun.HEADER.pack(len(body))], [out.fileno()])
                self.sock.sendall(body)
            except OSError:  # the spare did not take it (dead, or stuck): start cold
                self.discard()
                return None
        self.sock.close()
        return launcher.RunningAttempt(launch.number, self.proc, launch.log_path, self.started_at, launch.mark)

    def discard(self) -> None:
        """Stop the spare (parked, it has no children), reap it and close its channel. Its session goes back to
        the usual priority first: killed while it imports, at nice +19 beside busy ranks, it would be slow to exit."""
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                warmrun.set_session_nice(0, self.proc.pid)
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=_STOP_WAIT_S)


def park(
    number: int,
    python: str,
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    mark: procs.Mark,
    ignore_signals: tuple[int, ...] = (),
    log_path: Path | None = None,
) -> Spare:
    """Start a spare for attempt `number` under `python` (the interpreter torchrun runs under), behind the guard,
    in a session of its own, with `env` and the attempt's mark; its output before the message goes to `log_path`
    (opened never through a link; None: nowhere). Raises OSError when it cannot be started."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    wrapped, guard_env = guard.wrap([python, os.path.abspath(warmrun.__file__), MODULE], ignore=ignore_signals)
    started_at = time.time()
    try:
        with contextlib.ExitStack() as stack:
            out = subprocess.DEVNULL if log_path is None else stack.enter_context(statedir.open_append(log_path))
            proc = subprocess.Popen(
                wrapped,
                env={**env, **mark.environ(), **guard_env},
                cwd=cwd,
                stdin=theirs.fileno(),
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    # The guard names itself as the next guard's parent and execs: the spare's pid is the ranks' guards' parent.
    return Spare(number, python, mark, proc, ours, {**guard_env, guard.PARENT_ENV: str(proc.pid)}, started_at)
