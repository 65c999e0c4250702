"""Starting `ftsup run` is all or nothing: when a resource cannot start (the metrics port is taken, the heartbeat
socket's path cannot be bound), the start fails and whatever was started before it is released: no thread of
ours alive, no file descriptor left open (no socket, no log file, no lock), the signal handlers and the wakeup fd
put back, no socket file left, the runtime directory removed, the lock free for the next supervisor."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from ftsup.supervisor import statedir
from ftsup.supervisor.config.job import load_config
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.run.daemon import Daemon

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    """Daemon.run configures structlog for the process; put the test session's configuration back."""
    old = structlog.get_config()
    yield
    structlog.configure(**old)


def daemon(tmp: Path, **sections: dict[str, Any]) -> Daemon:
    """A daemon whose start gets as far as it can: an eviction file watcher (a thread), a metrics endpoint."""
    cfg: dict[str, Any] = {
        "job": {"command": [sys.executable, "-c", "pass"], "workdir": str(tmp), "state_dir": str(tmp / "state")},
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "eviction": {"file": str(tmp / "evicted"), "poll_interval_s": 0.05},
    }
    for name, keys in sections.items():
        cfg.setdefault(name, {}).update(keys)
    (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
    return Daemon(load_config(tmp / "job.yaml", hostname="node-a"))


def process_state() -> dict[str, Any]:
    """What a start that failed must leave as it found it: threads and open fds by identity (an fd number the start
    reused for something else is a new fd), so that one another test left, closing meanwhile, is no leak of ours."""
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the listing's own fd, or one closed since
            pass
    return {
        "threads": {(t.name, t.ident) for t in threading.enumerate()},
        "fds": fds,
        "handlers": [signal.getsignal(s) for s in SIGNALS],
        "wakeup_fd": wakeup_fd,
    }


def left_since(before: dict[str, Any]) -> dict[str, Any]:
    """What is alive, open or set now that was not in `before` (a thread, an fd, a changed handler): {} if nothing."""
    now = process_state()
    new = {k: now[k] - before[k] for k in now if isinstance(now[k], set) and now[k] - before[k]}
    return new | {k: (before[k], now[k]) for k in now if not isinstance(now[k], set) and now[k] != before[k]}


def lock_is_free(state_dir: Path) -> bool:
    statedir.InstanceLock(state_dir).close()  # raises UsageError while another holds it
    return True


def test_a_metrics_port_in_use_fails_the_start_and_leaves_nothing_started(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        d = daemon(tmp_path, metrics={"listen": f"127.0.0.1:{holder.getsockname()[1]}"})
        before = process_state()
        with pytest.raises(ConfigError, match="cannot serve /metrics there"):
            d.run()
        left = left_since(before)
    assert (left, (tmp_path / "state" / "run").exists(), lock_is_free(tmp_path / "state")) == ({}, False, True)


def test_a_heartbeat_socket_path_that_cannot_be_bound_fails_the_start_and_leaves_nothing_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # systemd's RuntimeDirectory is taken as given: here one whose socket path is too long for AF_UNIX (108 bytes).
    runtime = tmp_path / ("r" * 110)
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    d = daemon(tmp_path, metrics={"listen": "127.0.0.1:0"})
    before = process_state()
    with pytest.raises(OSError, match="AF_UNIX path too long"):
        d.run()
    left = left_since(before)
    assert (left, list(runtime.iterdir()), lock_is_free(tmp_path / "state")) == ({}, [], True)
    # The endpoint had started before the heartbeat socket (so had the signal handlers and the watcher's thread):
    # it was served, and is closed.
    assert d.metrics_server is not None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", d.metrics_server.port), timeout=5).close()
