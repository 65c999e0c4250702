"""Nodes that keep separate fast tiers, on a real S3 store (SeaweedFS on 127.0.0.1): each node sends its part of a
checkpoint and marks it, and the commit is made once, when every node's part is there (`durable.s3nodes`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import checksums, durable, layout, nodes
from ftsup.store.durable import s3nodes
from ftsup.store.durable.s3 import S3Tier
from ftsup.supervisor.config.job import parse_config
from ftsup.supervisor.durable.keeper import DurableKeeper
from ftsup.supervisor.telemetry.metrics import Metrics
from tests.procs import wait_for
from tests.s3fixtures import client
from tests.s3server import SeaweedS3

OPTIONS = durable.DurableOptions(part_bytes=5 << 20, concurrency=4, max_attempts=2, connect_timeout_s=2)
NODES = {"node-a": (0, 1), "node-b": (2,)}


def files() -> dict[str, bytes]:
    out = {"dcp_metadata.json": b'{"meta": 1}'}
    for rank in range(3):
        out[layout.shard_name(rank)] = bytes((rank + i) % 251 for i in range(70_000 + rank))
        out[layout.rank_state_name(rank)] = json.dumps({"rank": rank}).encode()
    return out


def node_copies(root: Path, step: int = 4, kind: str = "periodic") -> dict[str, Path]:
    """The copy of checkpoint `step` in each node's own fast tier: its node's files, its node file, one manifest."""
    data = files()
    entries = {rel: layout.FileEntry(len(d), checksums.checksum_bytes(d)) for rel, d in data.items()}
    manifest = layout.Manifest(
        step=step, world_size=3, kind=kind, created_unix=1.7e9, files=entries, tensor_bytes=1, nodes=NODES
    )
    raw = json.dumps(manifest.to_json()).encode()
    out = {}
    for node in NODES:
        ckpt = root / node / layout.step_dirname(step)
        ckpt.mkdir(parents=True)
        for rel in nodes.held_by(entries, NODES, node):
            (ckpt / rel).write_bytes(data[rel])
        (ckpt / nodes.NODE_FILE).write_bytes(nodes.node_file_bytes(node))
        (ckpt / layout.MANIFEST_NAME).write_bytes(raw)
        out[node] = ckpt
    return out


def test_a_node_whose_part_is_first_waits_and_nothing_is_listed(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        with pytest.raises(s3nodes.WaitingForNodes, match="node node-a's part"):
            tier.upload(copies["node-b"], node="node-b")
        listed = tier.list_checkpoints()
    assert listed.checkpoints == []


def test_the_last_node_commits_and_the_first_finds_it_committed(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-b"], node="node-b")
        last = tier.upload(copies["node-a"], node="node-a")
        again = tier.upload(copies["node-b"], node="node-b")
        info = tier.inspect(4, deep=True)
    assert (last.outcome, again.outcome, again.bytes_sent) == ("committed", "already", 0)
    assert info.consistent, info.problems


def test_the_committed_checkpoint_downloads_whole_with_every_nodes_files(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-a"], node="node-a")
        tier.upload(copies["node-b"], node="node-b")
        restored = tier.download(4, tmp_path / "new-vm")
    assert {p.name for p in restored.iterdir()} == set(files()) | {layout.MANIFEST_NAME}
    assert layout.inspect_checkpoint(restored, deep=True).consistent


def test_two_nodes_committing_at_once_commit_the_step_once(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    outcomes: list[str] = []
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        assert isinstance(tier, S3Tier)
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-a"], node="node-a")
        local = {node: durable.read_local(copies[node]) for node in NODES}
        mine = nodes.sent_by(local["node-b"].manifest.files, NODES, "node-b")
        s3nodes._send_files(tier, local["node-b"], mine, {"bytes_sent": 0, "parts_sent": 0, "parts_kept": 0}, None)
        folder = s3nodes.markers_folder(tier, 4, local["node-b"].token)
        entries = local["node-b"].manifest.files
        tier.put(folder + "node-b.json", nodes.marker_bytes("node-b", 4, {r: entries[r] for r in mine}))
        barrier = threading.Barrier(2)

        def commit(node: str) -> None:
            barrier.wait()
            outcomes.append(s3nodes.try_commit(tier, local[node]))

        threads = [threading.Thread(target=commit, args=(n,)) for n in NODES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(outcomes) == ["already", "committed"]


def test_deleting_the_checkpoint_removes_its_node_markers(bucket: str, tmp_path: Path, s3_server: SeaweedS3) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-a"], node="node-a")
        tier.upload(copies["node-b"], node="node-b")
        tier.delete(4)
    left = client(s3_server).list_objects_v2(Bucket=bucket).get("Contents", [])
    assert left == []


def test_a_marker_planted_for_a_node_whose_files_are_not_there_commits_nothing(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        assert isinstance(tier, S3Tier)
        local = durable.read_local(copies["node-b"])
        entries = local.manifest.files
        forged = nodes.marker_bytes("node-a", 4, {r: entries[r] for r in nodes.sent_by(entries, NODES, "node-a")})
        tier.put(s3nodes.markers_folder(tier, 4, local.token) + "node-a.json", forged)
        with pytest.raises(s3nodes.WaitingForNodes, match=r"shard-00000.safetensors \(missing\)"):
            tier.upload(copies["node-b"], node="node-b")
        assert tier.list_checkpoints().checkpoints == []


def test_a_nodes_own_marker_found_torn_is_written_again_and_the_step_commits(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        assert isinstance(tier, S3Tier)
        token = durable.read_local(copies["node-b"]).token
        tier.put(s3nodes.markers_folder(tier, 4, token) + "node-b.json", b'{"node": "node-b", "step": 4, "fi')
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-a"], node="node-a")
        assert tier.upload(copies["node-b"], node="node-b").outcome == "committed"
        assert tier.inspect(4, deep=True).consistent


def node_a_keeper(fast: Path, bucket: str, tmp_path: Path) -> tuple[DurableKeeper, list[tuple[str, dict[str, Any]]]]:
    """Node-a's durable keeper of a two-node job with node-local fast tiers (`fast` its own), and what it emits."""
    raw = {
        "job": {"command": ["true"]},
        "checkpoint": {
            "dir": str(fast),
            "dir_shared": False,
            "durable": {"url": f"s3://{bucket}/job", "part_bytes": 5 << 20},
        },
        "launch": {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400", "node_id": "node-a"},
    }
    cfg = parse_config(raw, source="job.yaml", base_dir=tmp_path, hostname="n")
    seen: list[tuple[str, dict[str, Any]]] = []
    keeper = DurableKeeper(
        cfg, emit=lambda level, event, **f: seen.append((event, f)), metrics=Metrics("r", "n-a", started_unix=0)
    )
    return keeper, seen


def test_an_eviction_waiting_for_another_nodes_part_says_what_it_waits_for(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    keeper, seen = node_a_keeper(tmp_path / "node-a", bucket, tmp_path)
    with keeper.running():
        keeper.saved(4, "emergency")

        def part_logged() -> bool:
            keeper.poll()
            return any(e == "durable_part_uploaded" for e, _ in seen)

        wait_for(part_logged, 60, "node-a's part was never uploaded")
        durable_now = keeper.wait_durable(4, 0.5, "the eviction")
    parts = [f for e, f in seen if e == "durable_part_uploaded"]
    missed = [f for e, f in seen if e == "durable_deadline_missed"]
    assert not durable_now and [p["step"] for p in parts] == [4] and parts[0]["node"] == "node-a"
    assert "waiting for: " in missed[0]["reason"] and "node node-b's part" in missed[0]["reason"]
    assert copies
