"""The supervisor's resume choice with a durable tier (`StoreScanner.with_durable_tier`): across both tiers, and the
fast tier's choice alone, said why, when the tier fails or does not answer in time."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftsup.store import durable
from ftsup.supervisor.state.ckptstore import StoreScanner
from tests.helpers import default_files, make_fake_checkpoint


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An HTTP endpoint on 127.0.0.1 that takes connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_the_resume_choice_takes_a_newer_durable_checkpoint_with_its_metadata(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 10, default_files(10))
    with durable.open_tier(str(tmp_path / "durable")) as tier:
        tier.upload(make_fake_checkpoint(tmp_path / "other", 20, default_files(20), metadata={"samples": 240}))
    scanner = StoreScanner(tmp_path / "ckpt").with_durable_tier(lambda: durable.open_tier(str(tmp_path / "durable")))
    got = scanner.choose(10)
    assert (got.tier, got.picked.info.step if got.picked.info else None, got.metadata, got.durable_error) == (
        "durable",
        20,
        {"samples": 240},
        None,
    )


def test_a_durable_tier_that_cannot_be_read_leaves_the_fast_choice_and_says_why(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 10, default_files(10))
    (tmp_path / "not-a-directory").write_bytes(b"")
    not_a_tier = str(tmp_path / "not-a-directory")
    scanner = StoreScanner(tmp_path / "ckpt").with_durable_tier(lambda: durable.open_tier(not_a_tier))
    got = scanner.choose(10)
    assert (got.tier, got.picked.info.step if got.picked.info else None) == ("fast", 10)
    assert got.durable_error is not None and "NotADirectoryError" in got.durable_error


def test_a_durable_tier_that_does_not_answer_in_time_leaves_the_fast_choice(
    tmp_path: Path, silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    nowhere = str(tmp_path / "none")
    credentials = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in {**credentials, "AWS_CONFIG_FILE": nowhere, "AWS_SHARED_CREDENTIALS_FILE": nowhere}.items():
        monkeypatch.setenv(name, value)
    make_fake_checkpoint(tmp_path / "ckpt", 10, default_files(10))
    options = durable.DurableOptions(endpoint_url=silent_endpoint, read_timeout_s=20, max_attempts=1)
    scanner = StoreScanner(tmp_path / "ckpt").with_durable_tier(
        lambda: durable.open_tier("s3://bucket/run", options), 0.5
    )
    got = scanner.choose(30)
    assert (got.tier, got.picked.info.step if got.picked.info else None) == ("fast", 10)
    assert got.durable_error == "no answer within 0.5s"


def test_with_node_local_fast_tiers_the_choice_is_the_durable_tiers_newest_over_a_newer_local_one(
    tmp_path: Path,
) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 30, default_files(30))  # committed here; other nodes' parts unknown
    with durable.open_tier(str(tmp_path / "durable")) as tier:
        tier.upload(make_fake_checkpoint(tmp_path / "other", 20, default_files(20)))
    opener = lambda: durable.open_tier(str(tmp_path / "durable"))  # noqa: E731
    got = StoreScanner(tmp_path / "ckpt").with_durable_tier(opener, durable_only=True).choose(10)
    assert (got.tier, got.picked.info.step if got.picked.info else None) == ("durable", 20)


def test_with_node_local_fast_tiers_a_tier_that_fails_leaves_the_fast_choice(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 30, default_files(30))
    (tmp_path / "not-a-directory").write_bytes(b"")
    opener = lambda: durable.open_tier(str(tmp_path / "not-a-directory"))  # noqa: E731
    got = StoreScanner(tmp_path / "ckpt").with_durable_tier(opener, durable_only=True).choose(10)
    assert (got.tier, got.picked.info.step if got.picked.info else None) == ("fast", 30)
