"""`ftsup ckpt list|verify s3://BUCKET/PREFIX` on a real S3 store (SeaweedFS on 127.0.0.1), as a user runs them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ftsup.store import durable
from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import run
from tests.s3fixtures import client
from tests.s3server import SeaweedS3

OPTIONS = durable.DurableOptions(concurrency=2, max_attempts=2)


def ftsup(*argv: str) -> tuple[int, str]:
    done = run([sys.executable, "-m", "ftsup.supervisor.cli", *argv], timeout=60, env=dict(os.environ))
    return done.returncode, done.output


def test_ckpt_list_json_shows_the_committed_checkpoints_of_an_s3_tier(bucket: str, tmp_path: Path) -> None:
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        for step in (10, 20):
            tier.upload(make_fake_checkpoint(tmp_path / "fast", step, default_files(step)))
    status, out = ftsup("ckpt", "list", f"s3://{bucket}/run", "--json", "--deep")
    rows = json.loads(out)["checkpoints"]
    assert status == 0
    assert [(r["step"], r["consistent"], r["path"]) for r in rows] == [
        (10, True, f"s3://{bucket}/run/step-000000010"),
        (20, True, f"s3://{bucket}/run/step-000000020"),
    ]


def test_ckpt_verify_deep_of_an_s3_tier_finds_a_flipped_byte_and_exits_1(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        tier.upload(make_fake_checkpoint(tmp_path / "fast", 3, default_files()))
        _, raw = tier.manifest(3)
    key = f"run/step-000000003/{durable.data_token(raw)}/shard-00001.safetensors"
    s3 = client(s3_server)
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[0] ^= 1
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    fast_status, fast_out = ftsup("ckpt", "verify", f"s3://{bucket}/run")
    deep_status, deep_out = ftsup("ckpt", "verify", f"s3://{bucket}/run", "--deep")
    assert (fast_status, deep_status) == (0, 1)
    assert "step-000000003: consistent" in fast_out
    assert "shard-00001.safetensors: checksum" in deep_out


def test_ckpt_list_of_an_s3_tier_with_credentials_refused_fails_in_one_line(bucket: str) -> None:
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="not-the-secret")
    done = run(
        [sys.executable, "-m", "ftsup.supervisor.cli", "ckpt", "list", f"s3://{bucket}/run"], timeout=60, env=env
    )
    assert done.returncode == 2
    assert done.output.strip().splitlines()[-1].startswith("ftsup: error: ")


def test_ckpt_list_of_an_s3_tier_mentions_an_upload_never_committed_without_listing_it(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        tier.upload(make_fake_checkpoint(tmp_path / "fast", 5, default_files()))
    client(s3_server).put_object(Bucket=bucket, Key="run/step-000000006/data-0123456789abcdef01234567/x", Body=b"x")
    status, out = ftsup("ckpt", "list", f"s3://{bucket}/run")
    lines = out.splitlines()
    assert status == 0
    table = lines[1 : lines.index("")]  # the rows under the header, up to the summary
    assert [line.split()[0] for line in table] == ["5"]
    assert "not a checkpoint: step-000000006/ (no manifest: an upload not committed)" in lines
