"""The durable tier's upload when the network between it and a real S3 store (SeaweedFS) fails: connections reset
mid-transfer (tests/tcpproxy.py), the store unreachable for a while (ftsup/store/DESIGN.md, "Durable tier")."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from ftsup.store import durable
from ftsup.store.errors import DurableTierError
from tests.helpers import default_files, make_fake_checkpoint
from tests.s3server import SeaweedS3
from tests.tcpproxy import CuttingProxy

OPTIONS = durable.DurableOptions(part_bytes=5 << 20, concurrency=4, max_attempts=3, connect_timeout_s=2)


def files() -> dict[str, bytes]:
    out = default_files()
    out["shard-00002.safetensors"] = bytes(i % 249 for i in range(4096)) * 5000  # four parts of 5 MiB, one short
    return out


def after(count: int, fault: Callable[[], None]) -> Callable[[str, int], None]:
    """A part hook that does `fault` once, when the `count`-th part has been sent (parts finish on many threads)."""
    lock, sent = threading.Lock(), [0]

    def hook(rel: str, number: int) -> None:
        with lock:
            sent[0] += 1
            if sent[0] == count:
                fault()

    return hook


def test_connections_reset_mid_upload_are_ridden_out_by_the_retries(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 11, files())
    with CuttingProxy(s3_server.ports[3]) as proxy:
        options = dataclasses.replace(OPTIONS, endpoint_url=proxy.endpoint)
        with durable.open_tier(f"s3://{bucket}/run", options) as tier:
            report = tier.upload(local, on_part=after(1, proxy.cut))
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as direct:
        info = direct.inspect(11, deep=True)
    assert (proxy.cuts, report.outcome, info.consistent) == (1, "committed", True)


def test_a_store_unreachable_mid_upload_fails_it_lists_nothing_and_the_next_upload_resumes(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 12, files())
    with CuttingProxy(s3_server.ports[3]) as proxy:

        def unreachable() -> None:
            proxy.refusing = True
            proxy.cut()

        options = dataclasses.replace(OPTIONS, endpoint_url=proxy.endpoint, max_attempts=2)
        with durable.open_tier(f"s3://{bucket}/run", options) as tier:
            with pytest.raises(DurableTierError):
                tier.upload(local, on_part=after(2, unreachable))
            with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as direct:
                meanwhile = direct.list_checkpoints()
            proxy.refusing = False
            report = tier.upload(local)
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as direct:
        info = direct.inspect(12, deep=True)
    assert meanwhile.checkpoints == []
    assert (report.outcome, report.parts_kept >= 2, info.consistent) == ("committed", True, True)


def test_a_part_whose_body_the_store_says_came_short_is_sent_again(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 13, files())
    with CuttingProxy(s3_server.ports[3]) as proxy:
        proxy.truncate_after(1 << 20)  # the first connection: its first part arrives with 1 MiB of its body
        options = dataclasses.replace(OPTIONS, endpoint_url=proxy.endpoint)
        with durable.open_tier(f"s3://{bucket}/run", options) as tier:
            report = tier.upload(local)
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as direct:
        info = direct.inspect(13, deep=True)
    assert (proxy.truncated, report.outcome, info.consistent) == (1, "committed", True)
