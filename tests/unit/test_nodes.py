"""Checkpoints of a job whose nodes keep separate fast tiers: the manifest's node field, the node file, the markers
of the durable tier and the commit rule (`ftsup.store.nodes`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import checksums, layout, nodes
from ftsup.store.errors import ManifestError

FILES = {
    "shard-00000.safetensors": b"a" * 100,
    "shard-00000.crc32": b"aaaa",
    "rank-00000.json": b"{}",
    "shard-00001.safetensors": b"b" * 50,
    "shard-00001.crc32": b"bbbb",
    "rank-00001.json": b"{}",
    "dcp_metadata.json": b"{}",
}
NODES = {"node-a": (0,), "node-b": (1,)}


def manifest(node_map: Any = NODES) -> layout.Manifest:
    entries = {rel: layout.FileEntry(len(d), checksums.checksum_bytes(d)) for rel, d in FILES.items()}
    return layout.Manifest(
        step=7, world_size=2, kind="periodic", created_unix=1.7e9, files=entries, tensor_bytes=150, nodes=node_map
    )


def raw(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def node_copy(root: Path, node: str, m: layout.Manifest | None = None) -> Path:
    """The copy of step 7 that `node`'s own store holds: its files, its node file, the shared manifest."""
    m = m or manifest()
    ckpt = root / layout.step_dirname(m.step)
    ckpt.mkdir(parents=True)
    for rel in nodes.held_by(m.files, NODES, node):
        (ckpt / rel).write_bytes(FILES[rel])
    (ckpt / nodes.NODE_FILE).write_bytes(nodes.node_file_bytes(node))
    (ckpt / layout.MANIFEST_NAME).write_bytes(json.dumps(m.to_json()).encode())
    return ckpt


# --------------------------------------------------------------------------- the manifest's node field


def test_the_node_field_round_trips_through_the_manifest() -> None:
    parsed = layout.parse_manifest(raw(manifest().to_json()))
    assert parsed.nodes == NODES


def test_a_manifest_without_the_node_field_reads_as_before() -> None:
    obj = manifest().to_json()
    del obj["nodes"]
    assert layout.parse_manifest(raw(obj)).nodes is None
    assert "nodes" not in manifest(None).to_json()


@pytest.mark.parametrize(
    "bad",
    [
        {},
        [],
        {"node-a": [0]},  # rank 1 on no node
        {"node-a": [0, 1], "node-b": [1]},  # rank 1 twice
        {"node-a": [0], "node-b": [2]},  # no rank 2 in world size 2
        {"node-a": [0], "node-b": [True]},
        {"node-a": [0], "../b": [1]},
        {"node-a": [0], "node-b": []},
        {"node-a": [0], "node-b": "1"},
    ],
)
def test_a_hostile_node_field_is_refused_naming_nodes(bad: Any) -> None:
    obj = manifest().to_json() | {"nodes": bad}
    with pytest.raises(ManifestError, match="nodes"):
        layout.parse_manifest(raw(obj))


def test_each_node_holds_its_ranks_files_and_the_files_of_every_node() -> None:
    m = manifest()
    assert nodes.held_by(m.files, NODES, "node-b") == [
        "dcp_metadata.json",
        "rank-00001.json",
        "shard-00001.crc32",
        "shard-00001.safetensors",
    ]
    assert "dcp_metadata.json" in nodes.sent_by(m.files, NODES, "node-a")
    assert "dcp_metadata.json" not in nodes.sent_by(m.files, NODES, "node-b")


# --------------------------------------------------------------------------- checks of a node-local store


def test_a_node_local_copy_is_consistent_without_the_other_nodes_files(tmp_path: Path) -> None:
    info = layout.inspect_checkpoint(node_copy(tmp_path, "node-b"))
    assert info.consistent, info.problems


def test_a_node_local_copy_missing_one_of_its_own_files_is_not_consistent(tmp_path: Path) -> None:
    ckpt = node_copy(tmp_path, "node-b")
    (ckpt / "shard-00001.safetensors").unlink()
    info = layout.inspect_checkpoint(ckpt)
    assert not info.consistent and [p.file for p in info.problems] == ["shard-00001.safetensors"]


def test_a_node_file_naming_a_node_the_manifest_lacks_is_not_consistent(tmp_path: Path) -> None:
    ckpt = node_copy(tmp_path, "node-b")
    (ckpt / nodes.NODE_FILE).write_bytes(b'{"node": "node-z"}')
    info = layout.inspect_checkpoint(ckpt)
    assert not info.consistent and info.problems[0].file == nodes.NODE_FILE


def test_a_node_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    ckpt = node_copy(tmp_path, "node-b")
    (tmp_path / "elsewhere").write_bytes(nodes.node_file_bytes("node-a"))
    (ckpt / nodes.NODE_FILE).unlink()
    (ckpt / nodes.NODE_FILE).symlink_to(tmp_path / "elsewhere")
    assert not layout.inspect_checkpoint(ckpt).consistent


def test_a_copy_without_a_node_file_must_hold_every_file(tmp_path: Path) -> None:
    ckpt = node_copy(tmp_path, "node-b")
    (ckpt / nodes.NODE_FILE).unlink()
    info = layout.inspect_checkpoint(ckpt)
    assert not info.consistent and "shard-00000.safetensors" in {p.file for p in info.problems}


# --------------------------------------------------------------------------- a copy of some files (a peer restore's)

SOME = ["dcp_metadata.json", "rank-00001.json", "shard-00000.crc32", "shard-00000.safetensors"]


def subset_copy(root: Path, rels: list[str], name: str = layout.subset_dirname(7)) -> Path:
    ckpt = root / name
    ckpt.mkdir(parents=True)
    for rel in rels:
        (ckpt / rel).write_bytes(FILES[rel])
    (ckpt / nodes.SUBSET_FILE).write_bytes(nodes.subset_file_bytes(rels))
    (ckpt / layout.MANIFEST_NAME).write_bytes(json.dumps(manifest().to_json()).encode())
    return ckpt


def test_a_subset_copy_holding_the_files_its_marker_names_verifies_deep(tmp_path: Path) -> None:
    info = layout.inspect_checkpoint(subset_copy(tmp_path, SOME), deep=True)
    assert (info.consistent, info.step) == (True, 7), info.problems


def test_a_subset_copy_missing_a_file_its_marker_names_is_not_consistent(tmp_path: Path) -> None:
    ckpt = subset_copy(tmp_path, SOME)
    (ckpt / "rank-00001.json").unlink()
    assert [p.file for p in layout.inspect_checkpoint(ckpt).problems] == ["rank-00001.json"]


def test_a_subset_marker_in_a_committed_step_is_ignored_and_every_file_checked(tmp_path: Path) -> None:
    info = layout.inspect_checkpoint(subset_copy(tmp_path, SOME, layout.step_dirname(7)))
    assert not info.consistent and "shard-00001.safetensors" in {p.file for p in info.problems}
    assert layout.committed_dirs(tmp_path) == [(7, tmp_path / layout.step_dirname(7))]
    assert layout.committed_dirs(subset_copy(tmp_path / "other", SOME).parent) == []  # never a committed step


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b'{"files": "dcp_metadata.json"}',
        b'{"files": ["nope.json"]}',
        b'{"files": [1]}',
        b'{"files": ["rank-00001.json", "rank-00001.json"]}',
        b'{"files": [], "more": 1}',
    ],
)
def test_a_hostile_subset_marker_is_not_consistent_naming_it(tmp_path: Path, body: bytes) -> None:
    ckpt = subset_copy(tmp_path, SOME)
    (ckpt / nodes.SUBSET_FILE).write_bytes(body)
    info = layout.inspect_checkpoint(ckpt)
    assert not info.consistent and info.problems[0].file == nodes.SUBSET_FILE, info.problems


def test_a_subset_copy_without_its_marker_is_not_consistent(tmp_path: Path) -> None:
    ckpt = subset_copy(tmp_path, SOME)
    (ckpt / nodes.SUBSET_FILE).unlink()
    assert [p.file for p in layout.inspect_checkpoint(ckpt).problems] == [nodes.SUBSET_FILE]


# --------------------------------------------------------------------------- markers and the commit rule


def test_a_marker_round_trips_listing_the_files_it_verified() -> None:
    m = manifest()
    mine = {rel: m.files[rel] for rel in nodes.sent_by(m.files, NODES, "node-b")}
    body = nodes.marker_bytes("node-b", 7, mine)
    assert nodes.parse_marker(body, "node-b", 7, m.files, "m") == sorted(mine)
    assert nodes.parse_marker_name(nodes.marker_name("node-b")) == "node-b"
    assert nodes.parse_marker_name("node-../x.json") is None


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"node": "node-a", "step": 7, "files": {}}',  # another node's
        b'{"node": "node-b", "step": 8, "files": {}}',  # another step's
        b'{"node": "node-b", "step": 7, "files": {"planted.bin": {"size": 1, "checksum": "x"}}}',
        b'{"node": "node-b", "step": 7, "files": {"rank-00001.json": {"size": 3, "checksum": "x"}}}',
        b'{"node": "node-b", "step": 7, "files": []}',
    ],
)
def test_a_hostile_marker_is_refused(body: bytes) -> None:
    with pytest.raises(ManifestError):
        nodes.parse_marker(body, "node-b", 7, manifest().files, "m")


def sizes() -> dict[str, int]:
    return {rel: len(d) for rel, d in FILES.items()}


def markers() -> dict[str, list[str]]:
    m = manifest()
    return {n: nodes.sent_by(m.files, NODES, n) for n in NODES}


def test_the_commit_is_made_once_every_node_marked_its_part_and_every_file_is_there() -> None:
    assert nodes.missing_for_commit(manifest().files, NODES, markers(), sizes()) == []


def test_the_commit_waits_for_a_node_whose_marker_is_not_there() -> None:
    got = markers()
    del got["node-a"]
    assert nodes.missing_for_commit(manifest().files, NODES, got, sizes()) == ["node node-a's part (no marker yet)"]


def test_the_commit_waits_for_a_file_not_at_its_size() -> None:
    short = sizes() | {"shard-00000.safetensors": 99}
    waiting = nodes.missing_for_commit(manifest().files, NODES, markers(), short)
    assert waiting == ["shard-00000.safetensors (99 bytes, recorded 100)"]


def test_the_commit_waits_for_a_marker_that_lists_less_than_its_ranks_files() -> None:
    got = markers() | {"node-b": ["shard-00001.safetensors"]}
    assert nodes.missing_for_commit(manifest().files, NODES, got, sizes()) == [
        "node node-b's marker lists not every file of its ranks"
    ]


def test_a_filesystem_tier_takes_a_one_node_checkpoint_whole_and_refuses_one_nodes_part(tmp_path: Path) -> None:
    from ftsup.store import durable
    from ftsup.store.errors import CheckpointError

    one = manifest({"node-a": (0, 1)})
    ckpt = node_copy(tmp_path / "a", "node-a", one)
    for rel in FILES:
        (ckpt / rel).write_bytes(FILES[rel])  # one node holds every file
    with durable.open_tier(str(tmp_path / "durable")) as tier:
        assert tier.upload(ckpt, node="node-a").outcome == "committed"
        with pytest.raises(CheckpointError, match="object storage"):
            tier.upload(node_copy(tmp_path / "b", "node-b", manifest()), node="node-b")
