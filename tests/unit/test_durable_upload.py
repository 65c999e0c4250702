"""The durable tier's uploader (supervisor/durable_upload.py) on a durable tier in tmp_path: a thread that uploads
what it is given, drops what cannot go, and stops when closed. Its retries of a store that is down: on a real S3
store, tests/integration/test_durable_uploader.py."""

from __future__ import annotations

from pathlib import Path

from ftsup.store import durable, layout
from ftsup.supervisor.durable_upload import Outcome, Uploader
from tests.helpers import default_files, flip_byte, make_fake_checkpoint
from tests.procs import wait_for


def tier(tmp_path: Path) -> durable.DurableTier:
    return durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2))


def test_a_submitted_checkpoint_becomes_durable_and_is_reported(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    local = make_fake_checkpoint(tmp_path / "fast", 8, default_files())
    with Uploader(tier(tmp_path), on_outcome=outcomes.append) as up:
        up.submit(local)
        became = up.wait_durable(8, timeout_s=30)
        status = up.status()
    assert (became, status.newest_durable, status.pending, status.last_error) == (True, 8, (), None)
    assert [(o.step, o.committed, o.attempts) for o in outcomes] == [(8, True, 1)]
    assert layout.inspect_checkpoint(tmp_path / "durable" / "step-000000008", deep=True).consistent


def test_a_local_checkpoint_that_does_not_verify_is_dropped_and_reported(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    local = make_fake_checkpoint(tmp_path / "fast", 9, default_files())
    flip_byte(local / "shard-00001.safetensors", 3)
    with Uploader(tier(tmp_path), on_outcome=outcomes.append) as up:
        up.submit(local)
        wait_for(lambda: outcomes, 30, "no outcome for the upload")
        became = up.wait_durable(9, timeout_s=30)
    assert (became, outcomes[0].committed) == (False, False)
    assert "shard-00001.safetensors: checksum" in (outcomes[0].error or "")


def test_a_step_already_durable_is_not_uploaded_again(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    local = make_fake_checkpoint(tmp_path / "fast", 4, default_files())
    with Uploader(tier(tmp_path), on_outcome=outcomes.append) as up:
        up.submit(local)
        up.wait_durable(4, timeout_s=30)
        up.submit(local)
        status = up.status()
    assert (len(outcomes), status.pending) == (1, ())


def test_closing_stops_the_thread(tmp_path: Path) -> None:
    up = Uploader(tier(tmp_path))
    up.close()
    assert not up.alive
