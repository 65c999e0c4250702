"""A durable tier whose store answers as no store should (tests/hostile_s3.py on 127.0.0.1): bounded listings, capped
reads, short ranges refused, the store's words escaped (ftsup/store/DESIGN.md, "Durable tier")."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ftsup.store import durable, layout
from ftsup.store.durable import s3list
from ftsup.store.errors import CheckpointCorruptError, DurableTierError
from tests.helpers import default_files, make_fake_checkpoint
from tests.hostile_s3 import HostileS3, Reply, Request, error, xml

NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
MANIFEST_KEY = "run/step-000000001/manifest.json"


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = {
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


def tier(store: HostileS3) -> durable.DurableTier:
    options = durable.DurableOptions(endpoint_url=store.endpoint, max_attempts=1, read_timeout_s=10, concurrency=2)
    return durable.open_tier("s3://bucket/run", options)


def listing(prefixes: list[str], *, truncated: bool, token: str = "") -> Reply:
    common = "".join(f"<CommonPrefixes><Prefix>{p}</Prefix></CommonPrefixes>" for p in prefixes)
    more = f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
    more += f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    return xml(
        f"<ListBucketResult {NS}><Name>bucket</Name><Prefix>run/</Prefix><KeyCount>{len(prefixes)}</KeyCount>"
        f"<MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter>{more}{common}</ListBucketResult>"
    )


def serve(answer: Callable[[Request, int], Reply]) -> HostileS3:
    """A hostile store answering with `answer(request, number of requests so far)`."""
    holder: list[HostileS3] = []
    store = HostileS3(lambda request: answer(request, len(holder[0].requests)))
    holder.append(store)
    return store


def test_a_listing_that_is_truncated_for_ever_fails_after_a_bounded_number_of_pages_naming_the_cap() -> None:
    with serve(lambda r, n: listing([], truncated=True, token=f"t{n}")) as store, tier(store) as t:
        with pytest.raises(DurableTierError) as caught:
            t.list_checkpoints()
    assert len(store.requests) == s3list.MAX_PAGES
    assert f"the listing from {store.endpoint} ran on (more than {s3list.MAX_PAGES} pages" in str(caught.value)


def test_a_listing_that_repeats_its_token_is_not_followed() -> None:
    with serve(lambda r, n: listing(["run/step-000000001/"], truncated=True, token="again")) as store, tier(store) as t:
        with pytest.raises(DurableTierError, match="the same continuation token twice"):
            t.list_checkpoints()
    assert len([r for r in store.requests if "list-type" in r.query]) == 2


def test_names_outside_the_prefix_asked_for_are_reported_never_read() -> None:
    def answer(request: Request, n: int) -> Reply:
        if "list-type" in request.query:
            return listing(["elsewhere/step-000000001/"], truncated=False)
        return error(404, "NoSuchKey", "no such key")

    with serve(answer) as store, tier(store) as t:
        listed = t.list_checkpoints()
    assert listed.checkpoints == [] and listed.others == [
        "elsewhere/step-000000001/ (a name outside the prefix asked for)"
    ]
    assert [r.key for r in store.requests if r.key] == []


def zeros(total: int) -> Iterator[bytes]:
    chunk = b" " * (1 << 20)
    for off in range(0, total, len(chunk)):
        yield chunk[: total - off]


def test_a_manifest_sent_whole_past_its_cap_is_refused_from_its_length() -> None:
    size = layout.MANIFEST_MAX_BYTES + 1000

    def answer(request: Request, n: int) -> Reply:
        return Reply(200, zeros(size), {"Content-Length": str(size)})  # the range ignored

    with serve(answer) as store, tier(store) as t:
        info = t.inspect(1)
    assert not info.consistent and f"over the {s3list.MANIFEST_MAX_BYTES}-byte limit" in str(info.problems[0])


def test_a_manifest_whose_range_claims_a_huge_object_is_refused_before_it_is_read() -> None:
    def answer(request: Request, n: int) -> Reply:
        return Reply(206, b"{}", {"Content-Range": "bytes 0-1/99999999999999"})

    with serve(answer) as store, tier(store) as t:
        info = t.inspect(1)
    assert "99999999999999 bytes, over the" in str(info.problems[0])


def test_a_range_answered_short_fails_the_download_and_commits_nothing(tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 1, default_files())
    raw = (local / layout.MANIFEST_NAME).read_bytes()

    def answer(request: Request, n: int) -> Reply:
        if request.key == MANIFEST_KEY:
            return Reply(200, raw)
        return Reply(206, b"short", {"Content-Range": "bytes 0-4/5"})

    with serve(answer) as store, tier(store) as t:
        with pytest.raises(CheckpointCorruptError, match="asked for"):
            t.download(1, tmp_path / "new-vm")
    assert os.listdir(tmp_path / "new-vm") == []  # nothing committed, nothing left


@pytest.mark.parametrize("says_length", [False, True])
def test_a_range_answered_long_is_refused_after_at_most_one_byte_past_it(tmp_path: Path, says_length: bool) -> None:
    """An answer to a ranged read with no length, or a length other than the range's, is read no further than one
    byte past the range: 64 MiB sent for a file of a few bytes stop at the socket's buffers."""
    local = make_fake_checkpoint(tmp_path / "fast", 1, default_files())
    raw = (local / layout.MANIFEST_NAME).read_bytes()
    sent = [0]
    total = 64 << 20

    def counted() -> Iterator[bytes]:
        for piece in zeros(total):
            sent[0] += len(piece)
            yield piece

    def answer(request: Request, n: int) -> Reply:
        if request.key == MANIFEST_KEY:
            return Reply(200, raw)
        return Reply(206, counted(), {"Content-Length": str(total)} if says_length else {})

    with serve(answer) as store, tier(store) as t:
        with pytest.raises(CheckpointCorruptError, match="asked for"):
            t.download(1, tmp_path / "new-vm")
    assert sent[0] < total // 2, sent[0]


def test_the_stores_error_message_reaches_the_user_escaped_and_cut_short(tmp_path: Path) -> None:
    said = "\u202egnissim\u202c " + "A" * 5000

    with serve(lambda r, n: error(403, "AccessDenied", said)) as store, tier(store) as t:
        with pytest.raises(DurableTierError) as caught:
            t.upload(make_fake_checkpoint(tmp_path / "fast", 1, default_files()))
    message = str(caught.value)
    assert "AccessDenied" in message and "\u202e" not in message and "\\u202e" in message
    assert len(message) < 400
