"""A durable tier behind a lying S3 endpoint (tests/lying_s3.py, a real SeaweedFS behind it): every answer is read
with a cap on its size and by a deadline, a listing past its cap is an error naming the endpoint and the cap, a read
plans nothing by what a manifest claims, and `ftsup ckpt list/verify` stay within 256 MiB of their idle memory
whatever the store sends (ftsup/store/DESIGN.md, "Hostile answers")."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ftsup.store import checksums, durable, layout
from ftsup.store.durable import s3http, s3list
from ftsup.store.errors import DurableTierError
from tests import lying_s3 as lies
from tests.helpers import default_files, make_fake_checkpoint
from tests.hostile_s3 import Reply, Request
from tests.lying_s3 import LyingS3
from tests.procs import BIN, run
from tests.s3fixtures import client
from tests.s3server import SeaweedS3

MIB = 1 << 20
BOUND_KIB = 256 * 1024  # the most a command's peak memory may exceed its idle peak
PREFIX = "run/"


def tier_of(
    bucket: str, store: LyingS3, *, request_timeout_s: float = 120.0, max_attempts: int = 1
) -> durable.DurableTier:
    options = durable.DurableOptions(
        endpoint_url=store.endpoint, max_attempts=max_attempts, concurrency=2, request_timeout_s=request_timeout_s
    )
    return durable.open_tier(f"s3://{bucket}/run", options)


def lying(s3_server: SeaweedS3, lie: Callable[[Request], Reply | None]) -> LyingS3:
    return LyingS3(s3_server.endpoint, lie)


def on_listings(reply: Callable[[Request], Reply]) -> Callable[[Request], Reply | None]:
    return lambda request: reply(request) if lies.is_listing(request) else None


PAST_CAP = f"ran past its cap of {s3http.ANSWER_MAX_BYTES}"
LISTING_LIES = {
    "a page without end": (lambda r: lies.endless_listing(PREFIX), f"ran past its cap of {s3http.ANSWER_MAX_BYTES}"),
    "one page of 1.5 million names": (
        lambda r: lies.huge_listing(PREFIX, 1_500_000),
        f"ran past its cap of {s3http.ANSWER_MAX_BYTES}",
    ),
    "XML nested a million deep": (
        lambda r: lies.nested_listing(1 << 20),
        f"ran past its cap of {s3http.ANSWER_MAX_BYTES}",
    ),
    "an error document without end": (lambda r: lies.endless_error(), f"ran past its cap of {s3http.ERROR_MAX_BYTES}"),
    "a page cut short": (
        lambda r: lies.truncated(200, lies.XML_HEAD + b"<IsTruncated>false</IsTruncated></ListBucketResult>", 20),
        "Connection was closed before we received a valid response",
    ),
}


@pytest.mark.parametrize("name", list(LISTING_LIES))
def test_a_listing_that_lies_fails_in_one_error_having_read_at_most_its_cap(
    bucket: str, s3_server: SeaweedS3, name: str
) -> None:
    reply, says = LISTING_LIES[name]
    with lying(s3_server, on_listings(reply)) as store, tier_of(bucket, store) as tier:
        with pytest.raises(DurableTierError) as caught:
            tier.list_checkpoints()
    retried = "cap" not in says  # a connection cut is retried as any is; an answer past its cap never
    assert (says in str(caught.value), store.lies) == (True, 2 if retried else 1)
    assert store.sent < 32 * MIB  # the cap, and what the sockets' buffers took before the reader stopped
    if "cap" in says:
        assert f"the answer of {store.endpoint} to ListObjectsV2" in str(caught.value)


def test_a_listing_of_thousands_of_pages_fails_at_the_page_cap_naming_the_endpoint(
    bucket: str, s3_server: SeaweedS3
) -> None:
    numbers = itertools.count(1)
    with lying(s3_server, on_listings(lambda r: lies.page(PREFIX, next(numbers)))) as store:
        with tier_of(bucket, store) as tier, pytest.raises(DurableTierError) as caught:
            tier.committed_steps()
    assert store.lies == s3list.MAX_PAGES
    assert f"the listing from {store.endpoint} ran on (more than {s3list.MAX_PAGES} pages" in str(caught.value)


def test_a_listing_sent_a_byte_at_a_time_ends_by_its_operations_deadline(bucket: str, s3_server: SeaweedS3) -> None:
    holder: list[LyingS3] = []
    trickled = on_listings(lambda r: Reply(200, holder[0].trickle(lies.XML_HEAD * 100, 0.02), {}))
    with lying(s3_server, trickled) as store, tier_of(bucket, store) as tier:
        holder.append(store)
        with tier.deadline(1.0), pytest.raises(DurableTierError) as caught:
            tier.list_checkpoints()
    assert f"{store.endpoint} gave no whole answer to ListObjectsV2 by its operation's deadline (1s)" in str(
        caught.value
    )


def test_a_request_answered_a_byte_at_a_time_fails_by_its_own_deadline_and_is_retried(
    bucket: str, s3_server: SeaweedS3
) -> None:
    holder: list[LyingS3] = []
    trickled = on_listings(lambda r: Reply(200, holder[0].trickle(lies.XML_HEAD * 100, 0.02), {}))
    with lying(s3_server, trickled) as store, tier_of(bucket, store, request_timeout_s=0.5, max_attempts=1) as tier:
        holder.append(store)
        with pytest.raises(DurableTierError, match=r"ListObjectsV2 took longer than 0.5s"):
            tier.list_checkpoints()
    assert store.lies == 2  # botocore's max_attempts counts the attempts after the first


def test_a_download_whose_shard_trickles_ends_by_its_deadline_and_commits_nothing(
    bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 1, default_files())
    holder: list[LyingS3] = []

    def lie(request: Request) -> Reply | None:
        if request.method == "GET" and request.key.endswith("shard-00000.safetensors"):
            return Reply(206, holder[0].trickle(b"\0" * 1000, 0.02), {})
        return None

    with lying(s3_server, lie) as store, tier_of(bucket, store) as tier:
        holder.append(store)
        tier.upload(local)
        with tier.deadline(1.0), pytest.raises(DurableTierError, match=r"by its operation's deadline \(1s\)"):
            tier.download(1, tmp_path / "new-vm")
    assert os.listdir(tmp_path / "new-vm") == []


# --------------------------------------------------------------------------- the commands' memory


def forged_claiming(bucket: str, s3_server: SeaweedS3, size: int) -> tuple[str, int]:
    """A committed step 5 whose manifest's one shard claims `size` bytes: (its data folder's key, its size)."""
    files = {"shard-00000.safetensors": layout.FileEntry(size, "crc32cx64k:00000000")}
    manifest = layout.Manifest(5, 1, "periodic", 1_700_000_000.0, files, 0)
    raw = layout.manifest_bytes(manifest)
    client(s3_server).put_object(Bucket=bucket, Key=f"{PREFIX}step-000000005/manifest.json", Body=raw)
    return f"{PREFIX}step-000000005/{durable.data_token(raw)}/", size


def zeros_for(request: Request) -> Reply:
    """The range asked for, in zeros, with its exact length: a store that claims to hold what it is asked for."""
    first, _, last = request.headers.get("Range", "bytes=0-0").removeprefix("bytes=").partition("-")
    length = int(last) - int(first) + 1

    def body() -> Iterator[bytes]:
        for at in range(0, length, MIB):
            yield bytes(min(MIB, length - at))

    return Reply(206, body(), {"Content-Length": str(length)})


def claiming_store(folder: str, size: int) -> Callable[[Request], Reply | None]:
    """Listings of `folder` agree with the manifest's claim; every read of the shard is answered as asked."""
    listing = (
        lies.XML_HEAD
        + (
            f"<Prefix>{folder}</Prefix><IsTruncated>false</IsTruncated><Contents><Key>{folder}shard-00000.safetensors</Key>"
            f"<Size>{size}</Size></Contents></ListBucketResult>"
        ).encode()
    )

    def lie(request: Request) -> Reply | None:
        if lies.is_listing(request) and request.query.get("prefix") == folder:
            return Reply(200, listing, {"Content-Type": "application/xml"})
        if request.method == "GET" and request.key.startswith(folder):
            return zeros_for(request)
        return None

    return lie


def peak(s3_server: SeaweedS3, store: LyingS3, *argv: str) -> tuple[int, int, str]:
    """(exit status, peak resident KiB, output) of `ftsup ARGV` against `store` (the real store's credentials)."""
    env = {**s3_server.env(), "AWS_ENDPOINT_URL_S3": store.endpoint}
    env |= {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    done = run(
        [sys.executable, str(BIN / "peak_rss.py"), "--", sys.executable, "-m", "ftsup.supervisor.cli", *argv],
        env=env,
        timeout=120,
    )
    out, _, last = done.output.rstrip().rpartition("\n")
    assert last.startswith("peak_rss_kib "), done.output[-2000:]
    return done.returncode, int(last.split()[1]), out


@pytest.fixture(scope="module")
def idle_kib(tmp_path_factory: pytest.TempPathFactory, s3_server: SeaweedS3) -> int:
    """The peak of `ftsup ckpt list` of an honest, empty tier: what a command costs whatever it reads."""
    name = "ftsup-test-idle"
    client(s3_server).create_bucket(Bucket=name)
    with lying(s3_server, lambda r: None) as store:
        status, kib, out = peak(s3_server, store, "ckpt", "list", f"s3://{name}/run")
    assert status == 0, out
    print(f"idle peak of ftsup ckpt list: {kib // 1024} MiB")
    return kib


COMMAND_LIES: dict[str, tuple[Callable[[Request], Reply | None], list[str]]] = {
    "a listing page without end": (on_listings(lambda r: lies.endless_listing(PREFIX)), ["list"]),
    "one page of 1.5 million names": (on_listings(lambda r: lies.huge_listing(PREFIX, 1_500_000)), ["list"]),
    "XML nested a million deep": (on_listings(lambda r: lies.nested_listing(1 << 20)), ["list"]),
    "an error document without end": (on_listings(lambda r: lies.endless_error()), ["verify"]),
}


@pytest.mark.parametrize("name", list(COMMAND_LIES))
def test_ftsup_ckpt_stays_within_256_mib_of_idle_and_fails_in_one_line_whatever_the_listing(
    bucket: str, s3_server: SeaweedS3, idle_kib: int, name: str
) -> None:
    lie, command = COMMAND_LIES[name]
    with lying(s3_server, lie) as store:
        status, kib, out = peak(s3_server, store, "ckpt", *command, f"s3://{bucket}/run")
    print(f"{name}: peak {kib // 1024} MiB, idle {idle_kib // 1024} MiB")
    assert (status, out.count("\n"), "Traceback" in out) == (2, 0, False), out[-2000:]
    assert kib - idle_kib <= BOUND_KIB


def test_a_deep_verify_of_a_shard_claiming_2_55_bytes_ends_by_its_timeout_within_256_mib_of_idle(
    bucket: str, s3_server: SeaweedS3, idle_kib: int
) -> None:
    folder, size = forged_claiming(bucket, s3_server, 1 << 55)
    with lying(s3_server, claiming_store(folder, size)) as store:
        status, kib, out = peak(s3_server, store, "ckpt", "verify", f"s3://{bucket}/run", "--deep", "--timeout", "3")
    print(f"deep verify of a 2**55-byte claim: peak {kib // 1024} MiB, idle {idle_kib // 1024} MiB")
    assert (status, "by its operation's deadline (3s)" in out, "Traceback" in out) == (2, True, False), out[-2000:]
    assert store.sent > 0 and kib - idle_kib <= BOUND_KIB


def test_a_verify_of_a_checkpoint_whose_dcp_metadata_points_outside_its_shard_is_not_consistent(
    bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "checkpoint-format1" / "step-000000007"
    ckpt = tmp_path / "fast" / fixture.name
    ckpt.parent.mkdir()
    ckpt.mkdir()
    for f in fixture.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    meta = json.loads((ckpt / layout.DCP_META_NAME).read_bytes())
    meta["storage"][0]["byte_offset"] = 10**12
    raw = json.dumps(meta).encode()
    (ckpt / layout.DCP_META_NAME).write_bytes(raw)
    manifest = json.loads((ckpt / layout.MANIFEST_NAME).read_bytes())
    manifest["files"][layout.DCP_META_NAME] = {"size": len(raw), "checksum": checksums.checksum_bytes(raw)}
    (ckpt / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
    with durable.open_tier(f"s3://{bucket}/run") as tier:
        tier.upload(ckpt)
    with lying(s3_server, lambda r: None) as store:
        fast = peak(s3_server, store, "ckpt", "verify", f"s3://{bucket}/run", "--json")
        deep = peak(s3_server, store, "ckpt", "verify", f"s3://{bucket}/run", "--json", "--deep")
    for status, _, out in (fast, deep):
        report = json.loads(out)
        assert (status, report["consistent"], [p["file"] for p in report["problems"]]) == (
            1,
            False,
            [layout.DCP_META_NAME],
        )
        assert "storage[0].byte_offset 1000000000000 + 40 bytes is not inside" in report["problems"][0]["reason"]
