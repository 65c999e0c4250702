"""The durable tier's pure parts (locations, options, part plans, names) and its filesystem backend, on tmp_path
(ftsup/store/DESIGN.md, "Durable tier"). The S3 backend is tested on a real store: test_durable_s3.py.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ftsup.extras import MissingExtraError
from ftsup.store import durable, layout
from ftsup.store.errors import CheckpointCorruptError, CheckpointError, DurableConflictError, NoCheckpointError
from tests.helpers import assert_whole_pieces, default_files, flip_byte, make_fake_checkpoint, read_back_in_pieces

BLOCK = layout.CHECKSUM_BLOCK_BYTES
OPTIONS = durable.DurableOptions(concurrency=2)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- locations and options


def test_an_s3_location_is_canonical_without_a_trailing_slash() -> None:
    loc = durable.parse_location("s3://my-bucket/runs/gpt/")
    assert (loc.url, loc.bucket, loc.prefix, loc.is_s3) == ("s3://my-bucket/runs/gpt", "my-bucket", "runs/gpt", True)


def test_a_bucket_alone_is_a_location_with_no_prefix() -> None:
    assert durable.parse_location("s3://bucket").prefix == ""


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("s3://UPPER/p", "not an S3 bucket name"),
        ("s3://ab/p", "not an S3 bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("s3://bucket/a//b", "empty"),
        ("s3://bucket/a\x01b", "holds a character"),
        ("gs://bucket/p", "is not s3"),
        ("relative/path", "must be absolute"),
        ("", "not a location"),
    ],
)
def test_a_bad_location_is_refused_naming_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(CheckpointError, match=says):
        durable.parse_location(url)


def test_a_path_is_a_filesystem_location(tmp_path: Path) -> None:
    loc = durable.parse_location(str(tmp_path / "durable"))
    assert (loc.is_s3, loc.path) == (False, tmp_path / "durable")


@pytest.mark.parametrize(
    "bad", [{"part_bytes": 4 << 20}, {"part_bytes": (8 << 20) + 1}, {"concurrency": 0}, {"max_attempts": 0}]
)
def test_options_out_of_range_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError):
        durable.DurableOptions(**bad)


# --------------------------------------------------------------------------- names and plans


def test_a_file_up_to_the_part_size_is_one_part_even_when_empty() -> None:
    assert durable.part_plan(0, 16 << 20) == [(0, 0)]
    assert durable.part_plan(16 << 20, 16 << 20) == [(0, 16 << 20)]


def test_parts_cover_the_file_exactly_in_order() -> None:
    size = (40 << 20) + 7
    plan = durable.part_plan(size, 16 << 20)
    assert plan == [(0, 16 << 20), (16 << 20, 16 << 20), (32 << 20, (8 << 20) + 7)]


def test_a_huge_file_gets_block_aligned_parts_and_at_most_ten_thousand() -> None:
    size = 200 << 30
    plan = durable.part_plan(size, 16 << 20)
    assert len(plan) <= durable.MAX_PARTS
    assert all(length % BLOCK == 0 for _, length in plan[:-1])
    assert sum(length for _, length in plan) == size


def test_the_composite_etag_is_the_md5_of_the_part_md5s_and_their_count() -> None:
    md5s = [hashlib.md5(b"a").digest(), hashlib.md5(b"b").digest()]
    assert durable.composite_etag(md5s) == hashlib.md5(md5s[0] + md5s[1]).hexdigest() + "-2"


def test_the_data_token_follows_from_the_manifest_bytes() -> None:
    one, other = durable.data_token(b"{}"), durable.data_token(b"{ }")
    assert durable.is_token(one) and one == durable.data_token(b"{}") and one != other


def test_a_name_read_from_a_tier_is_shown_escaped_and_cut_short() -> None:
    assert durable.clean_name("step\x1b[2J") == "step\\x1b[2J"
    assert durable.clean_name("x" * 500, 10) == "x" * 10 + "..."


# --------------------------------------------------------------------------- the filesystem backend


def test_a_filesystem_tier_commits_lists_and_downloads_bitwise(tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 12, default_files())
    with durable.open_tier(str(tmp_path / "durable"), OPTIONS) as tier:
        report = tier.upload(local)
        listed = tier.list_checkpoints(deep=True)
        restored = tier.download(12, tmp_path / "new-vm")
    assert (report.outcome, report.bytes_sent) == ("committed", report.bytes_total)
    assert [(c.step, c.consistent) for c in listed.checkpoints] == [(12, True)]
    assert tree(restored) == tree(local)
    assert layout.inspect_checkpoint(tmp_path / "durable" / "step-000000012", deep=True).consistent


def test_a_filesystem_tier_is_read_back_in_whole_pieces_even_when_its_reads_come_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared filesystem may answer a read with fewer bytes than asked before the end of the file: each piece is
    made whole before it is checksummed, so the block checksums still line up with the file's."""
    files = default_files()
    files["shard-00002.safetensors"] = bytes(range(256)) * ((durable.READ_CHUNK_BYTES + 2**20) // 256) + b"tail"
    local = make_fake_checkpoint(tmp_path / "fast", 12, files)
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real_pread(fd, min(n, 100_003), offset))
    with durable.open_tier(str(tmp_path / "durable"), OPTIONS) as tier:
        tier.upload(local)
        pieces = read_back_in_pieces(tier, 12)
        restored = tier.download(12, tmp_path / "new-vm")
    assert_whole_pieces(pieces, files)
    assert tree(restored) == tree(local)


def test_a_filesystem_tier_refuses_a_second_commit_of_a_step_with_other_content(tmp_path: Path) -> None:
    first = make_fake_checkpoint(tmp_path / "a", 5, default_files(1))
    second = make_fake_checkpoint(tmp_path / "b", 5, default_files(2))
    with durable.open_tier(str(tmp_path / "durable"), OPTIONS) as tier:
        tier.upload(first)
        with pytest.raises(DurableConflictError, match="already committed with other content"):
            tier.upload(second)
        again = tier.upload(first)
    assert again.outcome == "already"
    assert tree(tmp_path / "durable" / "step-000000005") == tree(first)


def test_a_filesystem_upload_that_stopped_keeps_the_files_that_verify(tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 3, default_files())
    tier = durable.open_tier(str(tmp_path / "durable"), OPTIONS)

    class Stop(Exception):
        pass

    def stop(rel: str, number: int) -> None:
        if rel == "shard-00001.safetensors":
            raise Stop()

    with pytest.raises(Stop):
        tier.upload(local, on_part=stop)
    listed = tier.list_checkpoints()
    report = tier.upload(local)
    assert listed.checkpoints == [] and any("an upload not committed" in o for o in listed.others)
    assert report.outcome == "committed" and report.parts_kept >= 1
    assert layout.inspect_checkpoint(tmp_path / "durable" / "step-000000003", deep=True).consistent


def test_a_local_checkpoint_that_does_not_match_its_manifest_never_reaches_a_filesystem_tier(tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 4, default_files())
    flip_byte(local / "shard-00000.safetensors", 10)
    tier = durable.open_tier(str(tmp_path / "durable"), OPTIONS)
    with pytest.raises(CheckpointCorruptError, match="shard-00000.safetensors: checksum"):
        tier.upload(local)
    with pytest.raises(NoCheckpointError):
        tier.manifest(4)


def test_a_flipped_byte_in_a_filesystem_tier_fails_the_download_and_commits_nothing(tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 6, default_files())
    tier = durable.open_tier(str(tmp_path / "durable"), OPTIONS)
    tier.upload(local)
    flip_byte(tmp_path / "durable" / "step-000000006" / "shard-00000.safetensors", BLOCK + 1)
    with pytest.raises(CheckpointCorruptError, match="shard-00000.safetensors: checksum"):
        tier.download(6, tmp_path / "new-vm")
    assert os.listdir(tmp_path / "new-vm") == []  # nothing committed, nothing left


def test_a_filesystem_delete_removes_that_checkpoint_only(tmp_path: Path) -> None:
    tier = durable.open_tier(str(tmp_path / "durable"), OPTIONS)
    for step in (1, 2):
        tier.upload(make_fake_checkpoint(tmp_path / "fast", step, default_files(step)))
    tier.delete(1)
    assert [c.step for c in tier.list_checkpoints().checkpoints] == [2]
    assert sorted(os.listdir(tmp_path / "durable")) == ["step-000000002"]


def test_an_upload_takes_only_a_committed_checkpoint_directory(tmp_path: Path) -> None:
    partial = make_fake_checkpoint(tmp_path / "fast", 7, default_files(), partial=True)
    with pytest.raises(CheckpointError, match="not a committed checkpoint directory"):
        durable.open_tier(str(tmp_path / "durable"), OPTIONS).upload(partial)


# --------------------------------------------------------------------------- the durable extra


def test_an_s3_tier_without_boto3_names_the_durable_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # what `import boto3` meets where it is not installed
    monkeypatch.delitem(sys.modules, "ftsup.store.durable.s3", raising=False)
    monkeypatch.delattr(importlib.import_module("ftsup.store.durable"), "s3", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'ftsup\[durable\]'"):
        durable.open_tier("s3://bucket/prefix")


def test_ftsup_ckpt_list_of_a_bad_s3_location_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from ftsup.supervisor.cli.commands import main

    assert main(["ckpt", "list", "s3://Bad_Bucket/run"]) == 2
    assert "not an S3 bucket name" in capsys.readouterr().err


def test_what_a_killed_filesystem_upload_left_in_its_folder_is_not_committed(tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 3, default_files())
    token = durable.data_token((local / layout.MANIFEST_NAME).read_bytes())
    folder = tmp_path / "durable" / f".step-000000003.upload-{token}"
    folder.mkdir(parents=True)
    (folder / ".shard-00000.safetensors.tmp-0123abcd").write_bytes(b"half a copy")
    durable.open_tier(str(tmp_path / "durable"), OPTIONS).upload(local)
    assert sorted(os.listdir(tmp_path / "durable" / "step-000000003")) == sorted(os.listdir(local))
