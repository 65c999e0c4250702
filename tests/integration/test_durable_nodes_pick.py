"""Nodes that keep separate fast tiers agree on what goes durable, and what a step that never committed left in
the tier is cleaned up, on a real S3 store (SeaweedFS on 127.0.0.1): `ftsup.store.durable.s3nodes.follows` and `sweep`,
and the durable tier's retention pass (`ftsup/store/DESIGN.md`, Node-local fast tiers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup.store import durable
from ftsup.store.durable import s3nodes
from ftsup.store.durable.s3 import S3Tier
from tests.integration.test_durable_nodes import OPTIONS, node_a_keeper, node_copies
from tests.procs import wait_for
from tests.s3fixtures import client
from tests.s3server import SeaweedS3


def _keys(s3_server: SeaweedS3, bucket: str) -> set[str]:
    return {o["Key"] for o in client(s3_server).list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_a_periodic_checkpoint_waits_on_another_node_until_rank_0s_node_marked_it(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        with pytest.raises(s3nodes.WaitingForLeader, match="not picked by node node-a"):
            tier.follows(copies["node-b"], "node-b", True)
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-a"], node="node-a")
        assert tier.follows(copies["node-b"], "node-b", False) == "follow"


def test_rank_0s_node_uploads_what_its_policy_picked_and_skips_the_rest(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        verdicts = (tier.follows(copies["node-a"], "node-a", True), tier.follows(copies["node-a"], "node-a", False))
    assert verdicts == ("go", "skip")


def test_another_node_uploads_an_emergency_checkpoint_it_picked_itself(bucket: str, tmp_path: Path) -> None:
    copies = node_copies(tmp_path, kind="emergency")
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        assert tier.follows(copies["node-b"], "node-b", True) == "go"


def test_a_step_never_committed_loses_its_marked_objects_and_keeps_a_planted_one(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        assert isinstance(tier, S3Tier)
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-a"], node="node-a")
        token = durable.read_local(copies["node-a"]).token
        planted = tier.data_key(4, token, "planted.bin")
        tier.put(planted, b"not named by any marker")
        removed = tier.sweep(4, {"node-a", "node-b"})
    assert _keys(s3_server, bucket) == {planted}
    assert removed == 6  # node-a's five files and its marker


def test_a_committed_step_is_not_swept(bucket: str, tmp_path: Path, s3_server: SeaweedS3) -> None:
    copies = node_copies(tmp_path)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(copies["node-a"], node="node-a")
        tier.upload(copies["node-b"], node="node-b")
        before = _keys(s3_server, bucket)
        assert tier.sweep(4, {"node-a", "node-b"}) == 0
    assert _keys(s3_server, bucket) == before


def test_retention_after_two_newer_commits_sweeps_the_superseded_step(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    old, mid = node_copies(tmp_path / "old", step=4), node_copies(tmp_path / "mid", step=8)
    new = node_copies(tmp_path / "new", step=12)
    with durable.open_tier(f"s3://{bucket}/job", OPTIONS) as tier:
        assert isinstance(tier, S3Tier)
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(old["node-a"], node="node-a")  # step 4: node-b's part never comes
        planted = tier.data_key(4, durable.read_local(old["node-a"]).token, "planted.bin")
        tier.put(planted, b"not named by any marker")
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(mid["node-b"], node="node-b")
        tier.upload(mid["node-a"], node="node-a")  # step 8 committed
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(new["node-b"], node="node-b")
    fast = new["node-a"].parent
    keeper, seen = node_a_keeper(fast, bucket, tmp_path)
    with keeper.running():
        keeper.saved(12, "emergency")

        def swept() -> bool:
            keeper.poll()
            return any(e == "durable_deleted" and f["step"] == 4 for e, f in seen)

        wait_for(swept, 60, f"step 4 was never swept: {seen}")
    left = {k for k in _keys(s3_server, bucket) if "/step-000000004/" in k}
    assert left == {planted}
