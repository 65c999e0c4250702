"""The durable tier on a real S3 store (SeaweedFS on 127.0.0.1): upload, atomic commit, listing, checks, download,
delete, resumption after the store stopped mid-upload, and a hostile store (ftsup/store/DESIGN.md, "Durable tier")."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil
import pytest

from ftsup.store import durable, layout
from ftsup.store.durable import s3list, s3upload
from ftsup.store.errors import CheckpointCorruptError, DurableConflictError, DurableTierError, NoCheckpointError
from tests.helpers import assert_whole_pieces, default_files, flip_byte, make_fake_checkpoint, read_back_in_pieces
from tests.procs import wait_for
from tests.s3fixtures import client, start_server, use_server
from tests.s3server import SeaweedS3

OPTIONS = durable.DurableOptions(part_bytes=5 << 20, concurrency=4, max_attempts=2, connect_timeout_s=2)


def big_files(seed: int = 0) -> dict[str, bytes]:
    """The default files and a shard of four parts at OPTIONS.part_bytes (the last one short)."""
    files = default_files(seed)
    files["shard-00002.safetensors"] = bytes((seed + i) % 253 for i in range(256)) * (70 * 1024 + 3)
    return files


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def keys(server: SeaweedS3, name: str) -> list[str]:
    got = client(server).list_objects_v2(Bucket=name)
    return sorted(o["Key"] for o in got.get("Contents", []))


def test_an_upload_commits_and_lists_and_verifies_deep_and_downloads_bitwise(bucket: str, tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 12, big_files())
    with durable.open_tier(f"s3://{bucket}/run/a", OPTIONS) as tier:
        report = tier.upload(local)
        listed = tier.list_checkpoints(deep=True)
        restored = tier.download(12, tmp_path / "new-vm")
    assert (report.outcome, report.files, report.bytes_sent, report.parts_kept) == (
        "committed",
        4,
        report.bytes_total,
        0,
    )
    assert [(c.step, c.consistent, c.path) for c in listed.checkpoints] == [
        (12, True, f"s3://{bucket}/run/a/step-000000012")
    ]
    assert listed.others == []
    assert tree(restored) == tree(local)
    assert layout.inspect_checkpoint(restored, deep=True).consistent


def test_a_read_back_hands_over_each_ranged_get_in_whole_pieces_checked_as_they_arrive(
    bucket: str, tmp_path: Path
) -> None:
    """Each 16 MiB ranged GET is checksummed and written a 1 MiB piece at a time (while the CPU's cache holds it),
    never as a whole 16 MiB answer; the pieces are the file's, block-aligned, so the checksums still verify."""
    files = default_files()
    files["shard-00002.safetensors"] = bytes(range(256)) * ((durable.READ_CHUNK_BYTES + 3 * 2**20) // 256) + b"tail"
    local = make_fake_checkpoint(tmp_path / "fast", 13, files)
    with durable.open_tier(f"s3://{bucket}/run/pieces", OPTIONS) as tier:
        tier.upload(local)
        pieces = read_back_in_pieces(tier, 13)
    assert_whole_pieces(pieces, files)
    assert len(pieces["shard-00002.safetensors"]) == 16 + 4


def test_the_same_checkpoint_uploaded_again_is_already_committed_and_sends_nothing(bucket: str, tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 3, default_files())
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        tier.upload(local)
        again = tier.upload(local)
    assert (again.outcome, again.bytes_sent) == ("already", 0)


def test_a_second_commit_of_a_step_with_other_content_is_refused_and_the_first_stays(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    first = make_fake_checkpoint(tmp_path / "a", 5, default_files(1))
    second = make_fake_checkpoint(tmp_path / "b", 5, default_files(2))
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        tier.upload(first)
        with pytest.raises(DurableConflictError, match="already committed with other content"):
            tier.upload(second)
        _, raw = tier.manifest(5)
        restored = tier.download(5, tmp_path / "restored")
    assert raw == (first / layout.MANIFEST_NAME).read_bytes()
    assert tree(restored) == tree(first)


def test_two_writers_racing_for_a_step_commit_it_once_and_the_loser_leaves_nothing(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    winner = make_fake_checkpoint(tmp_path / "a", 30, big_files(1))
    loser = make_fake_checkpoint(tmp_path / "b", 30, big_files(2))
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as a, durable.open_tier(f"s3://{bucket}/run", OPTIONS) as b:
        raced: list[durable.UploadReport] = []
        once = threading.Lock()

        def the_other_commits_first(rel: str, number: int) -> None:
            with once:  # the loser has started sending (on several threads); the winner does its whole upload now
                if not raced:
                    raced.append(a.upload(winner))

        with pytest.raises(DurableConflictError, match="already committed with other content"):
            b.upload(loser, on_part=the_other_commits_first)
        _, raw = b.manifest(30)
    assert [r.outcome for r in raced] == ["committed"]
    assert raw == (winner / layout.MANIFEST_NAME).read_bytes()
    lost = durable.data_token((loser / layout.MANIFEST_NAME).read_bytes())
    assert [k for k in keys(s3_server, bucket) if lost in k] == []  # the loser's files were its own: deleted


def test_two_writers_of_the_same_checkpoint_racing_both_succeed_and_commit_it_once(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    files = big_files(4)
    mine, theirs = (make_fake_checkpoint(tmp_path / name, 31, files) for name in ("a", "b"))
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as a, durable.open_tier(f"s3://{bucket}/run", OPTIONS) as b:
        raced: list[durable.UploadReport] = []
        once = threading.Lock()

        def the_other_finishes_first(rel: str, number: int) -> None:
            with once:  # both send into the same keys; the other completes its uploads and commits meanwhile
                if not raced:
                    raced.append(a.upload(theirs))

        report = b.upload(mine, on_part=the_other_finishes_first)
        info = b.inspect(31, deep=True)
    assert sorted([raced[0].outcome, report.outcome]) == ["already", "committed"]
    assert info.consistent


def test_the_store_stopped_mid_upload_lists_nothing_then_the_upload_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(tmp_path / "seaweedfs")
    try:
        use_server(monkeypatch, server, tmp_path)
        client(server).create_bucket(Bucket="resume")
        local = make_fake_checkpoint(tmp_path / "fast", 40, big_files(3))
        sent: list[tuple[str, int]] = []

        def stop_after_two(rel: str, number: int) -> None:
            sent.append((rel, number))
            if len(sent) == 2:
                server.stop()

        with durable.open_tier("s3://resume/job", OPTIONS) as tier:
            with pytest.raises(DurableTierError):
                tier.upload(local, on_part=stop_after_two)
            server.start()
            before = tier.list_checkpoints()
            report = tier.upload(local)
            after = tier.list_checkpoints(deep=True)
            restored = tier.download(40, tmp_path / "new-vm")
    finally:
        server.stop()
    assert before.checkpoints == []
    assert report.outcome == "committed" and report.parts_kept >= 2
    assert report.bytes_sent < report.bytes_total
    assert [(c.step, c.consistent) for c in after.checkpoints] == [(40, True)]
    assert tree(restored) == tree(local)


def test_a_flipped_byte_in_a_durable_file_is_caught_by_a_deep_check_and_by_a_download(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 8, big_files())
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        tier.upload(local)
        _, raw = tier.manifest(8)
        key = f"run/step-000000008/{durable.data_token(raw)}/shard-00002.safetensors"
        s3 = client(s3_server)
        data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[6 << 20] ^= 0xFF
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        fast = tier.inspect(8)
        deep = tier.inspect(8, deep=True)
        with pytest.raises(CheckpointCorruptError, match="shard-00002.safetensors: checksum"):
            tier.download(8, tmp_path / "new-vm")
    assert fast.consistent
    assert [(p.file, p.reason.split(" ")[0]) for p in deep.problems] == [("shard-00002.safetensors", "checksum")]
    assert os.listdir(tmp_path / "new-vm") == []  # nothing committed, nothing left


def test_a_local_checkpoint_that_does_not_match_its_manifest_is_never_committed(bucket: str, tmp_path: Path) -> None:
    local = make_fake_checkpoint(tmp_path / "fast", 9, big_files())
    flip_byte(local / "shard-00002.safetensors", 12 << 20)
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        with pytest.raises(CheckpointCorruptError, match="shard-00002.safetensors: checksum"):
            tier.upload(local)
        with pytest.raises(NoCheckpointError):
            tier.manifest(9)


def test_names_ftsup_never_writes_are_reported_and_never_listed_as_checkpoints(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    s3 = client(s3_server)
    good = make_fake_checkpoint(tmp_path / "fast", 2, default_files())
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        tier.upload(good)
        for key in (
            "run/step-12/manifest.json",
            "run/step-000000003\x01/manifest.json",
            "run/notes.txt",
            "run/step-0000000000000000000000004/manifest.json",
        ):
            s3.put_object(Bucket=bucket, Key=key, Body=(good / layout.MANIFEST_NAME).read_bytes())
        listed = tier.list_checkpoints()
    assert [c.step for c in listed.checkpoints] == [2]
    assert sorted(listed.others) == sorted(
        [
            "notes.txt (an object beside the checkpoints)",
            "step-12/ (not a checkpoint name)",
            "step-000000003\\x01/ (not a checkpoint name)",
            "step-0000000000000000000000004/ (not a checkpoint name)",
        ]
    )


def test_a_manifest_of_another_step_or_naming_a_path_outside_is_not_consistent(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    s3 = client(s3_server)
    other = make_fake_checkpoint(tmp_path / "fast", 6, default_files())
    s3.put_object(Bucket=bucket, Key="run/step-000000007/manifest.json", Body=(other / "manifest.json").read_bytes())
    escaping = (other / "manifest.json").read_text().replace('"rank-00000/state.json"', '"../../state.json"')
    s3.put_object(Bucket=bucket, Key="run/step-000000006/manifest.json", Body=escaping.encode())
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        listed = {c.step: c for c in tier.list_checkpoints().checkpoints}
    assert not listed[7].consistent and "records step 6" in str(listed[7].problems[0])
    assert not listed[6].consistent and "'..'" in str(listed[6].problems[0])


def test_an_oversized_manifest_is_refused_naming_the_limit(bucket: str, s3_server: SeaweedS3) -> None:
    s3 = client(s3_server)
    s3.put_object(Bucket=bucket, Key="run/step-000000001/manifest.json", Body=b" " * (s3list.MANIFEST_MAX_BYTES + 1))
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        info = tier.inspect(1)
    assert not info.consistent
    assert f"over the {s3list.MANIFEST_MAX_BYTES}-byte limit" in str(info.problems[0])


def test_delete_removes_the_manifest_and_only_the_objects_it_names(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    s3 = client(s3_server)
    with durable.open_tier(f"s3://{bucket}/run", OPTIONS) as tier:
        tier.upload(make_fake_checkpoint(tmp_path / "fast", 1, default_files(1)))
        tier.upload(make_fake_checkpoint(tmp_path / "fast", 2, default_files(2)))
        _, raw = tier.manifest(1)
        planted = f"run/step-000000001/{durable.data_token(raw)}/not-ours.bin"
        s3.put_object(Bucket=bucket, Key=planted, Body=b"x")
        removed = tier.delete(1)
        listed = tier.list_checkpoints(deep=True)
    assert removed == 4
    assert [c.step for c in listed.checkpoints] == [2] and listed.checkpoints[0].consistent
    assert [k for k in keys(s3_server, bucket) if k.startswith("run/step-000000001/")] == [planted]


def test_without_a_bucket_the_upload_fails_naming_it(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    use_server(monkeypatch, s3_server, tmp_path)
    local = make_fake_checkpoint(tmp_path / "fast", 1, default_files())
    with durable.open_tier("s3://no-such-bucket/run", OPTIONS) as tier:
        with pytest.raises(DurableTierError, match="NoSuchBucket"):
            tier.upload(local)


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_the_endpoint_comes_from_a_standard_variable(
    variable: str, bucket: str, tmp_path: Path, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv(variable, s3_server.endpoint)
    with durable.open_tier(f"s3://{bucket}", OPTIONS) as tier:
        tier.upload(make_fake_checkpoint(tmp_path / "fast", 4, default_files()))
    assert "step-000000004/manifest.json" in keys(s3_server, bucket)


def test_the_store_listens_and_connects_on_loopback_only(s3_server: SeaweedS3) -> None:
    assert s3_server.proc is not None
    conns = psutil.Process(s3_server.proc.pid).net_connections(kind="inet")
    addresses = {c.laddr.ip for c in conns} | {c.raddr.ip for c in conns if c.raddr}
    assert conns and all(a.startswith("127.") for a in addresses), addresses


def test_an_upload_held_inside_part_bodies_commits_the_same_bytes(bucket: str, tmp_path: Path) -> None:
    """The pause hook is called before each part and between the pieces of each body (`_PausingBody`); a body held
    mid-way, then let go, still sends every byte exactly once."""
    local = make_fake_checkpoint(tmp_path / "fast", 7, big_files(3))
    calls: list[float] = []
    held = threading.Event()
    go = threading.Event()

    def pause(at_most_s: float) -> None:
        calls.append(at_most_s)
        if at_most_s == durable.BODY_PAUSE_S and not held.is_set():
            held.set()
            go.wait(at_most_s)  # one body stops here until the test lets it go

    with durable.open_tier(f"s3://{bucket}/held", OPTIONS) as tier:
        t = threading.Thread(target=lambda: tier.upload(local, pause=pause), daemon=True)
        t.start()
        wait_for(held.is_set, 60, "no pause inside a part's body")
        go.set()
        t.join(60)
        restored = tier.download(7, tmp_path / "new-vm")
    assert not t.is_alive()
    assert tree(restored) == tree(local)
    assert calls.count(float("inf")) >= 4  # one before each part: the big shard's four, and each small file's


def _thread_rchar() -> int:
    with open("/proc/thread-self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_an_upload_reads_and_hashes_a_part_a_piece_at_a_time_between_pauses(bucket: str, tmp_path: Path) -> None:
    """A hold that begins while a part is being read stops the upload within a piece, not after the whole part: no
    thread reads more than one piece (and the small answers of the store) between two calls of the pause hook."""
    local = make_fake_checkpoint(tmp_path / "fast", 8, big_files(4))
    last: dict[int, int] = {}
    most: list[int] = []

    def pause(at_most_s: float) -> None:
        now = _thread_rchar()
        before = last.get(threading.get_ident())
        if before is not None:
            most.append(now - before)
        last[threading.get_ident()] = now

    with durable.open_tier(f"s3://{bucket}/pieces", OPTIONS) as tier:
        tier.upload(local, pause=pause)
        restored = tier.download(8, tmp_path / "new-vm")
    assert tree(restored) == tree(local)
    assert s3upload.PIECE_BYTES % layout.CHECKSUM_BLOCK_BYTES == 0  # a piece's block checksums are whole blocks
    assert max(most) <= s3upload.PIECE_BYTES + (64 << 10), max(most)
    assert len(most) >= 20  # the shard's four parts: a call before each and between their pieces, read and sent
