"""The S3 backend's pure parts: keys, the size a ranged answer gives, which endpoints are AWS's, and the store's
words in an error (ftsup/store/DESIGN.md, "Durable tier"). No request is made: making a client connects nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from ftsup.store import durable
from ftsup.store.durable import s3
from ftsup.store.errors import ManifestError


@pytest.fixture()
def tier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> s3.S3Tier:
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
    options = durable.DurableOptions(endpoint_url="http://127.0.0.1:9")
    made = durable.open_tier("s3://bucket/runs/a", options)
    assert isinstance(made, s3.S3Tier)
    return made


def test_keys_are_under_the_prefix_and_the_data_folder(tier: s3.S3Tier) -> None:
    token = durable.data_token(b"{}")
    assert tier.manifest_key(12) == "runs/a/step-000000012/manifest.json"
    assert tier.data_key(12, token, "rank-00000/state.json") == f"runs/a/step-000000012/{token}/rank-00000/state.json"


def test_a_file_name_that_would_leave_its_folder_gets_no_key(tier: s3.S3Tier) -> None:
    with pytest.raises(ManifestError, match="'..'"):
        tier.data_key(1, durable.data_token(b"{}"), "../../other/manifest.json")


def test_a_store_that_is_not_aws_gets_the_bucket_in_the_path(tier: s3.S3Tier) -> None:
    assert tier.client.meta.config.s3 == {"addressing_style": "path"}


@pytest.mark.parametrize(
    ("endpoint", "aws"),
    [
        ("https://s3.amazonaws.com", True),
        ("https://s3.eu-west-1.amazonaws.com", True),
        ("http://127.0.0.1:8333", False),
        ("https://minio.internal:9000", False),
        ("https://amazonaws.com.evil", False),
    ],
)
def test_which_endpoints_are_aws(endpoint: str, aws: bool) -> None:
    assert s3._is_aws(endpoint) == aws


@pytest.mark.parametrize(
    ("answer", "size"),
    [
        ({"ContentRange": "bytes 0-9/1234"}, 1234),
        ({"ContentLength": 77}, 77),
        ({"ContentRange": "bytes 0-9/*", "ContentLength": 10}, None),
        ({"ContentRange": "bytes 0-9/" + "9" * 30}, None),
    ],
)
def test_the_whole_size_a_ranged_answer_gives(answer: dict[str, object], size: int | None) -> None:
    assert s3._total_size(answer) == size


def test_the_stores_error_message_is_escaped_and_cut_short() -> None:
    said = ClientError({"Error": {"Code": "Slow\x1bDown", "Message": "\x1b[2J" + "x" * 1000}}, "GetObject")
    message = str(s3.s3_error("s3://b/k: cannot read", said))
    assert "\x1b" not in message and "\\x1b" in message and len(message) < 250
