"""How the durable tier sends a file's parts to the real S3 store (`durable.s3upload`, `S3Tier.put`): each with
the Content-MD5 the store checks, signed through that header rather than by a second hash of the payload, and every
part read into the thread's part buffer arriving with its own bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from ftsup.store import durable
from ftsup.store.durable import s3upload
from tests.helpers import default_files, make_fake_checkpoint
from tests.s3fixtures import client
from tests.s3server import SeaweedS3

OPTIONS = durable.DurableOptions(part_bytes=5 << 20, concurrency=2, max_attempts=1, connect_timeout_s=2)


def _files() -> dict[str, bytes]:
    """Two multipart files of different bytes, each of several full parts and a short last one, and small ones."""
    files = default_files(1)
    part = OPTIONS.part_bytes
    files["shard-00002.safetensors"] = (bytes(range(251)) * (4 * part // 251))[: 3 * part + 1000]
    files["shard-00003.safetensors"] = (bytes(range(241, 0, -1)) * (3 * part // 241))[: 2 * part + 7]
    return files


def _open(bucket: str) -> Any:
    """The tier under test, an `S3Tier` (its client and keys are the test's to observe)."""
    return durable.open_tier(f"s3://{bucket}/run", OPTIONS)


def _requests(tier: Any) -> list[tuple[str, dict[str, str]]]:
    """Every request the tier's client sends from now on: (operation, headers), as they leave the client."""
    seen: list[tuple[str, dict[str, str]]] = []

    def record(request: Any, **kwargs: Any) -> None:
        operation = kwargs["event_name"].rpartition(".")[2]
        headers = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in request.headers.items()}
        seen.append((operation, headers))

    tier.client.meta.events.register("before-send.s3", record)
    return seen


def test_every_part_goes_with_its_content_md5_and_an_unsigned_payload_over_http(bucket: str, tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 5, _files())
    with _open(bucket) as tier:
        assert tier.client.meta.endpoint_url.startswith("http://")
        seen = _requests(tier)
        tier.upload(local)
    writes = [h for op, h in seen if op in ("UploadPart", "PutObject")]
    assert len([op for op, _ in seen if op == "UploadPart"]) == 4 + 3
    assert {(h.get("X-Amz-Content-SHA256"), "Content-MD5" in h) for h in writes} == {("UNSIGNED-PAYLOAD", True)}
    assert all("content-md5" in h["Authorization"].partition("SignedHeaders=")[2] for h in writes)


def test_a_request_without_content_md5_still_has_its_payload_signed(bucket: str) -> None:
    with _open(bucket) as tier:
        seen = _requests(tier)
        tier.client.put_object(Bucket=bucket, Key="plain", Body=b"no md5 here")
    assert [(op, h["X-Amz-Content-SHA256"]) for op, h in seen] == [
        ("PutObject", hashlib.sha256(b"no md5 here").hexdigest())
    ]


def test_a_part_whose_bytes_are_not_its_content_md5_is_refused_by_the_store(bucket: str) -> None:
    with _open(bucket) as tier:
        key = tier.key("torn")
        upload_id = tier.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        sent = bytearray(b"x" * (5 << 20))
        md5 = hashlib.md5(sent).digest()
        sent[12345] ^= 1  # torn on the way: the bytes no longer match the signed header
        with pytest.raises(ClientError) as caught:
            tier.client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=sent, ContentMD5=s3upload.b64(md5)
            )
        tier.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    assert caught.value.response["Error"]["Code"] in ("BadDigest", "InvalidDigest")


def test_parts_read_through_one_reused_buffer_each_arrive_with_their_own_bytes(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    files = _files()
    local = make_fake_checkpoint(tmp_path / "fast", 6, files)
    with _open(bucket) as tier:
        tier.upload(local)
        token = durable.read_local(local).token
        stored = {
            rel: client(s3_server).get_object(Bucket=bucket, Key=tier.data_key(6, token, rel))["Body"].read()
            for rel in files
        }
    assert {rel: hashlib.sha256(b).hexdigest() for rel, b in stored.items()} == {
        rel: hashlib.sha256(b).hexdigest() for rel, b in files.items()
    }
