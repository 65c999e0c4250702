"""The torch-free checkpoint store: checksums, manifests, listing, quarantine, retention."""

from __future__ import annotations

import io
import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import blocksum, checksums, layout
from ftsup.store.errors import CheckpointCorruptError, ManifestError, NoCheckpointError
from tests.helpers import default_files, flip_byte, make_fake_checkpoint, write_manifest_json

BLOCK = layout.CHECKSUM_BLOCK_BYTES


def valid_manifest_json(**overrides: Any) -> dict[str, Any]:
    obj = layout.Manifest(
        step=100,
        world_size=2,
        kind="periodic",
        created_unix=1_700_000_000.0,
        files={"a/shard.bin": layout.FileEntry(size=3, checksum=checksums.checksum_bytes(b"abc"))},
        tensor_bytes=3,
        metadata={"global_batch_size": 8},
    ).to_json()
    obj.update(overrides)
    return obj


def parse(obj: dict[str, Any]) -> layout.Manifest:
    return layout.parse_manifest(json.dumps(obj), where="m.json")


# --------------------------------------------------------------------------- names


def test_step_dirnames_are_zero_padded_and_round_trip() -> None:
    assert layout.step_dirname(1200) == "step-000001200"
    assert layout.parse_step_dirname("step-000001200") == 1200
    assert layout.parse_partial_dirname(layout.partial_dirname(7)) == 7


def test_partial_and_corrupt_names_are_not_committed_steps() -> None:
    names = ["step-000000007.partial", "step-000000007.corrupt", "step-7", "x-000000007"]
    assert [layout.parse_step_dirname(n) for n in names] == [None, None, None, None]


# --------------------------------------------------------------------------- checksums


def test_block_crcs_cover_each_64k_block_and_a_short_tail() -> None:
    data = bytes(range(256)) * (BLOCK // 256) * 2 + b"tail"
    expected = [
        blocksum.crc32c_python(data[:BLOCK]),
        blocksum.crc32c_python(data[BLOCK : 2 * BLOCK]),
        blocksum.crc32c_python(b"tail"),
    ]
    assert checksums.block_crcs(data) == expected


def test_block_crcs_of_the_older_algorithm_are_zlib_crc32() -> None:
    data = bytes(range(256)) * (BLOCK // 256) + b"tail"
    assert checksums.block_crcs(data, algorithm="crc32x64k") == [zlib.crc32(data[:BLOCK]), zlib.crc32(b"tail")]


def test_block_crcs_append_to_the_list_given() -> None:
    crcs = [7]
    assert (checksums.block_crcs(b"abc", crcs), crcs) == ([7, blocksum.crc32c_python(b"abc")],) * 2


def test_block_crcs_pack_and_unpack_round_trip() -> None:
    crcs = [0, 1, 0xFFFFFFFF, 12345]
    assert checksums.unpack_block_crcs(checksums.pack_block_crcs(crcs)) == crcs


def test_file_checksum_equals_checksum_of_its_bytes(tmp_path: Path) -> None:
    data = os.urandom(3 * BLOCK + 17)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert checksums.file_checksum(path) == checksums.checksum_bytes(data)


def test_file_checksum_of_empty_file_equals_checksum_of_no_bytes(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.write_bytes(b"")
    assert checksums.file_checksum(path) == checksums.checksum_bytes(b"")


class _ShortReads(io.RawIOBase):
    """Hands out at most `piece` bytes per read, as a network filesystem may."""

    def __init__(self, data: bytes, piece: int):
        self.data, self.pos, self.piece = data, 0, piece

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.piece, len(self.data) - self.pos)
        b[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_file_checksum_is_independent_of_how_reads_are_split() -> None:
    data = os.urandom(5 * BLOCK + 999)
    crcs = checksums.stream_block_crcs(_ShortReads(data, 10_007))
    assert checksums.checksum_from_block_crcs(crcs) == checksums.checksum_bytes(data)


def test_file_checksum_of_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # no writer: an open for reading that waits would never return
    with pytest.raises(CheckpointCorruptError, match="not a regular file"):
        checksums.file_checksum(tmp_path / "fifo")


def test_checksum_names_its_algorithm() -> None:
    assert (checksums.checksum_bytes(b"x")[:11], checksums.checksum_bytes(b"x", "crc32x64k")[:10]) == (
        "crc32cx64k:",
        "crc32x64k:",
    )


def test_file_checksum_of_the_older_algorithm_equals_its_checksum_of_the_bytes(tmp_path: Path) -> None:
    data = os.urandom(2 * BLOCK + 5)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert checksums.file_checksum(path, "crc32x64k") == checksums.checksum_bytes(data, "crc32x64k")


@pytest.mark.parametrize("recorded", ["crc32x64k", "md5:00000000", "crc32cx64k:0000000", "crc32cx64k:0000000G"])
def test_recorded_checksum_without_a_known_algorithm_and_8_hex_digits_is_refused(recorded: str) -> None:
    with pytest.raises(ManifestError, match="upgrade ftsup"):
        checksums.checksum_matches(b"", recorded)


# --------------------------------------------------------------------------- manifest


def test_manifest_round_trips_through_json() -> None:
    obj = valid_manifest_json()
    assert parse(obj).to_json() == obj


@pytest.mark.parametrize(
    "bad_path",
    ["/etc/passwd", "../outside.bin", "a/../../b", "a//b", "a/./b", "a\\b", "trailing/", ".", "..", "", "a\x00b"],
)
def test_manifest_refuses_unsafe_file_paths_naming_them(bad_path: str) -> None:
    obj = valid_manifest_json(files={bad_path: {"size": 1, "checksum": "crc32x64k:00000000"}})
    with pytest.raises(ManifestError) as e:
        parse(obj)
    assert repr(bad_path) in str(e.value)


def test_manifest_refuses_to_list_itself() -> None:
    obj = valid_manifest_json(files={layout.MANIFEST_NAME: {"size": 1, "checksum": "crc32x64k:00000000"}})
    with pytest.raises(ManifestError, match="must not list itself"):
        parse(obj)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("step", "100"),
        ("step", True),
        ("world_size", 2.0),
        ("kind", 3),
        ("created_unix", "yesterday"),
        ("tensor_bytes", None),
        ("files", []),
    ],
)
def test_manifest_wrong_type_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ManifestError) as e:
        parse(valid_manifest_json(**{key: value}))
    assert f"'{key}'" in str(e.value)


def test_manifest_missing_key_names_the_key() -> None:
    obj = valid_manifest_json()
    del obj["world_size"]
    with pytest.raises(ManifestError, match="'world_size' is missing"):
        parse(obj)


def test_manifest_file_entry_wrong_type_names_the_file_and_key() -> None:
    obj = valid_manifest_json(files={"s.bin": {"size": "3", "checksum": "crc32x64k:00000000"}})
    with pytest.raises(ManifestError) as e:
        parse(obj)
    assert ("'s.bin'" in str(e.value), "'size'" in str(e.value)) == (True, True)


def test_manifest_unsupported_format_version_says_to_upgrade() -> None:
    with pytest.raises(ManifestError, match="format_version 2 is not supported.*upgrade"):
        parse(valid_manifest_json(format_version=2))


def test_manifest_unknown_kind_is_refused() -> None:
    with pytest.raises(ManifestError, match="kind 'hourly'"):
        parse(valid_manifest_json(kind="hourly"))


def test_manifest_other_checksum_algorithm_is_refused() -> None:
    with pytest.raises(ManifestError, match="'sha256' is not supported.*upgrade"):
        parse(valid_manifest_json(checksum_algorithm="sha256"))


def test_manifest_is_written_with_crc32c() -> None:
    obj = valid_manifest_json()
    assert (obj["checksum_algorithm"], obj["files"]["a/shard.bin"]["checksum"][:11]) == ("crc32cx64k", "crc32cx64k:")


def test_manifest_of_an_earlier_version_keeps_its_crc32_algorithm() -> None:
    old = checksums.checksum_bytes(b"abc", "crc32x64k")
    obj = valid_manifest_json(checksum_algorithm="crc32x64k", files={"s.bin": {"size": 3, "checksum": old}})
    manifest = parse(obj)
    assert (manifest.checksum_algorithm, manifest.to_json()) == ("crc32x64k", obj)


def test_manifest_without_an_algorithm_is_read_as_crc32x64k() -> None:
    obj = valid_manifest_json(files={"s.bin": {"size": 3, "checksum": checksums.checksum_bytes(b"abc", "crc32x64k")}})
    del obj["checksum_algorithm"]
    assert parse(obj).checksum_algorithm == "crc32x64k"


def test_manifest_file_checksum_of_another_algorithm_than_the_manifests_is_refused() -> None:
    obj = valid_manifest_json(files={"s.bin": {"size": 3, "checksum": checksums.checksum_bytes(b"abc", "crc32x64k")}})
    with pytest.raises(ManifestError, match=r"files\['s.bin'\] checksum 'crc32x64k:.*' is not 'crc32cx64k:"):
        parse(obj)


def test_deep_check_of_an_older_checkpoint_uses_its_algorithm(tmp_path: Path) -> None:
    ckpt = make_fake_checkpoint(tmp_path, 100, default_files())
    obj = json.loads((ckpt / layout.MANIFEST_NAME).read_text())
    for rel, entry in obj["files"].items():
        entry["checksum"] = checksums.file_checksum(ckpt / rel, "crc32x64k")
    obj["checksum_algorithm"] = "crc32x64k"
    write_manifest_json(ckpt, obj)
    flip_byte(ckpt / sorted(obj["files"])[0])
    _, problems = layout.check_checkpoint(ckpt, deep=True)
    assert [(p.file, p.reason.startswith("checksum crc32x64k:")) for p in problems] == [(sorted(obj["files"])[0], True)]


def test_manifest_that_is_not_json_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        layout.parse_manifest(b'{"step": 1', where="m.json")


def test_manifest_in_wrong_directory_is_refused(tmp_path: Path) -> None:
    ckpt = make_fake_checkpoint(tmp_path, 100, {"a": b"a"})
    moved = ckpt.rename(tmp_path / layout.step_dirname(200))
    with pytest.raises(ManifestError, match="records step 100 but lives in step-000000200"):
        layout.read_manifest(moved)


# --------------------------------------------------------------------------- resolve_inside


def test_resolve_inside_accepts_a_nested_file(tmp_path: Path) -> None:
    assert layout.resolve_inside(tmp_path, "a/b.bin") == tmp_path.resolve() / "a" / "b.bin"


def test_resolve_inside_refuses_a_symlink_escaping_the_checkpoint(tmp_path: Path) -> None:
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"secret")
    ckpt = tmp_path / "step-000000001"
    ckpt.mkdir()
    (ckpt / "shard.bin").symlink_to(outside)
    with pytest.raises(ManifestError, match="outside the checkpoint"):
        layout.resolve_inside(ckpt, "shard.bin")


def test_check_reports_an_escaping_symlink_as_a_problem_of_that_file(tmp_path: Path) -> None:
    ckpt = make_fake_checkpoint(tmp_path / "ckpts", 1, {"shard.bin": b"secret"})
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"secret")  # same size and content: only the escape is wrong
    (ckpt / "shard.bin").unlink()
    (ckpt / "shard.bin").symlink_to(outside)
    _, problems = layout.check_checkpoint(ckpt, deep=True)
    assert [p.file for p in problems] == ["shard.bin"]


# --------------------------------------------------------------------------- listing


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """100 and 200 good; 300 with a wrong size; 400 without manifest; 500 torn (.partial)."""
    root = tmp_path / "ckpts"
    make_fake_checkpoint(root, 100, default_files(1))
    make_fake_checkpoint(root, 200, default_files(2))
    bad = make_fake_checkpoint(root, 300, default_files(3))
    with open(bad / "shard-00001.safetensors", "ab") as f:
        f.write(b"x")
    make_fake_checkpoint(root, 400, default_files(4), manifest=False)
    make_fake_checkpoint(root, 500, default_files(5), partial=True)
    return root


def test_list_shows_committed_dirs_oldest_first_without_partials(store: Path) -> None:
    infos = layout.list_checkpoints(store)
    assert [(i.step, i.consistent) for i in infos] == [
        (100, True),
        (200, True),
        (300, False),
        (400, False),
    ]


def test_list_names_the_file_with_a_wrong_size(store: Path) -> None:
    info = layout.list_checkpoints(store)[2]
    assert [str(p) for p in info.problems] == ["shard-00001.safetensors: size 1001 != recorded 1000"]


def test_list_reports_a_missing_manifest_as_a_manifest_problem(store: Path) -> None:
    info = layout.list_checkpoints(store)[3]
    assert ([p.file for p in info.problems], info.kind) == ([layout.MANIFEST_NAME], None)


def test_list_reports_a_missing_file(tmp_path: Path) -> None:
    ckpt = make_fake_checkpoint(tmp_path, 1, default_files())
    (ckpt / "rank-00000" / "state.json").unlink()
    info = layout.inspect_checkpoint(ckpt)
    assert [str(p) for p in info.problems] == ["rank-00000/state.json: missing"]


def test_list_of_a_missing_root_is_empty(tmp_path: Path) -> None:
    assert layout.list_checkpoints(tmp_path / "nope") == []


def test_latest_consistent_skips_broken_newer_checkpoints(store: Path) -> None:
    info = layout.latest_consistent(store)
    assert info is not None and info.step == 200


def test_latest_consistent_below_a_step(store: Path) -> None:
    info = layout.latest_consistent(store, below=200)
    assert info is not None and info.step == 100


def test_flipped_byte_is_seen_only_by_the_deep_check(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 100, default_files(1))
    ckpt = make_fake_checkpoint(tmp_path, 200, default_files(2))
    flip_byte(ckpt / "shard-00000.safetensors", offset=BLOCK + 5)
    fast = layout.latest_consistent(tmp_path)
    deep = layout.latest_consistent(tmp_path, deep=True)
    assert (fast and fast.step, deep and deep.step) == (200, 100)


def test_deep_check_names_the_flipped_file(tmp_path: Path) -> None:
    ckpt = make_fake_checkpoint(tmp_path, 100, default_files())
    flip_byte(ckpt / "shard-00001.safetensors")
    _, problems = layout.check_checkpoint(ckpt, deep=True)
    assert [p.file for p in problems] == ["shard-00001.safetensors"]


def test_find_checkpoint_without_any_raises_no_checkpoint(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 100, default_files(), manifest=False)
    with pytest.raises(NoCheckpointError):
        layout.find_checkpoint(tmp_path, None)


def test_find_checkpoint_of_an_absent_step_raises_no_checkpoint(store: Path) -> None:
    with pytest.raises(NoCheckpointError, match="step 150"):
        layout.find_checkpoint(store, 150)


# --------------------------------------------------------------------------- quarantine


def test_quarantine_renames_to_corrupt_keeping_the_files(tmp_path: Path) -> None:
    ckpt = make_fake_checkpoint(tmp_path, 100, {"a.bin": b"a"})
    dst = layout.quarantine(ckpt)
    assert (dst.name, (dst / "a.bin").read_bytes()) == ("step-000000100.corrupt", b"a")


def test_quarantine_never_overwrites_earlier_evidence(tmp_path: Path) -> None:
    layout.quarantine(make_fake_checkpoint(tmp_path, 100, {"a.bin": b"first"}))
    dst = layout.quarantine(make_fake_checkpoint(tmp_path, 100, {"a.bin": b"second"}))
    assert (dst.name, (tmp_path / "step-000000100.corrupt" / "a.bin").read_bytes()) == (
        "step-000000100.corrupt.1",
        b"first",
    )


def test_quarantined_checkpoint_is_no_longer_listed(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 100, {"a.bin": b"a"})
    layout.quarantine(make_fake_checkpoint(tmp_path, 200, {"a.bin": b"b"}))
    assert [i.step for i in layout.list_checkpoints(tmp_path)] == [100]


def test_write_json_atomic_leaves_no_temporary_file(tmp_path: Path) -> None:
    write_manifest_json(tmp_path, {"x": 1})
    assert [p.name for p in tmp_path.iterdir()] == [layout.MANIFEST_NAME]
