"""The durable tier's uploader (supervisor/durable/upload.py) on a real S3 store (SeaweedFS) that is down when the
checkpoint comes: it is tried again with a backoff, nothing is listed meanwhile, and it commits once the store is
back, resuming (ftsup/store/DESIGN.md, "Durable tier")."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup.store import durable
from ftsup.supervisor.durable.upload import Outcome, Uploader
from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import wait_for
from tests.s3fixtures import client, start_server, use_server

OPTIONS = durable.DurableOptions(concurrency=2, max_attempts=1, connect_timeout_s=1)


def test_a_store_down_when_the_checkpoint_comes_is_retried_until_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(tmp_path / "seaweedfs")
    outcomes: list[Outcome] = []
    try:
        use_server(monkeypatch, server, tmp_path)
        client(server).create_bucket(Bucket="uploads")
        server.stop()
        local = make_fake_checkpoint(tmp_path / "fast", 21, default_files())
        with durable.open_tier("s3://uploads/job", OPTIONS) as tier:
            with Uploader(tier, backoff_initial_s=0.1, backoff_max_s=0.5, on_outcome=outcomes.append) as up:
                up.submit(local)
                failing = wait_for(lambda: up.status().last_error, 30, "the store being down was never seen")
                server.start()
                became = up.wait_durable(21, timeout_s=60)
            listed = tier.list_checkpoints(deep=True)
    finally:
        server.stop()
    assert "cannot" in failing
    assert became and [(o.step, o.committed) for o in outcomes] == [(21, True)] and outcomes[0].attempts >= 2
    assert [(c.step, c.consistent) for c in listed.checkpoints] == [(21, True)]
