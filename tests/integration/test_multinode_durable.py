"""Two supervisors on 127.0.0.1 acting as two nodes of one job, each with its own fast tier
(`checkpoint.dir_shared: false`) and one bucket of a real S3 store (SeaweedFS) as the durable tier.

Each node uploads its part of every checkpoint and the last one commits it: the bucket holds one commit per step.
Node B is SIGKILLed and its fast tier wiped (a new machine); B started again rejoins, its rank reads its share of
the checkpoint from the store, and the job completes with every step's samples in order.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
from pathlib import Path

import pytest

from ftsup.store import durable
from ftsup.store.layout import read_manifest
from ftsup.store.nodes import node_of_rank
from tests.helpers import node_read_events
from tests.integration import test_multinode as multinode
from tests.integration.test_multinode import STEPS, lines, start
from tests.procs import free_port, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess


def node_config(tmp: Path, node: str, port: int, url: str) -> Path:
    checkpoint = {
        "dir": str(tmp / node / "ckpt"),
        "dir_shared": False,
        "durable": {"url": url, "keep_last": 100, "part_bytes": 5 << 20, "periodic_every": 2},
    }
    # A start that never reaches its first step is a hang taken with its evidence (every rank's stacks in an
    # incident) well within the test's own time, rather than a timeout that leaves nothing to read.
    heartbeat = {"startup_timeout_s": 90}
    return multinode.node_config(tmp, node, port, run_id="mn-durable-test", checkpoint=checkpoint, heartbeat=heartbeat)


def hangs(tmp: Path) -> str:
    """Every hang's incident record the two nodes wrote (every rank's stacks), for a failure's message."""
    found = [p.read_text() for p in sorted(tmp.glob("node-*/incidents/*.json"))]
    return "\n".join(text[:6000] for text in found if json.loads(text).get("trigger") == "hang")


def events(tmp: Path, node: str, name: str) -> list[dict]:
    return [e for e in lines(tmp / node / "logs" / "supervisor.jsonl") if e.get("event") == name]


def node_reads(root: Path) -> list[dict]:
    """Every `checkpoint_node_read` a rank logged under `root`: its files read locally and from the store."""
    return [
        e
        for path in root.rglob("*")
        if path.is_file() and "ckpt" not in path.parts
        for e in node_read_events(path.read_text(errors="replace"))
    ]


def test_two_nodes_with_separate_fast_tiers_commit_once_per_step_and_a_wiped_node_rejoins_from_the_store(
    tmp_path: Path, bucket: str
) -> None:
    url = f"s3://{bucket}/job"
    port = free_port()
    a_cfg, b_cfg = node_config(tmp_path, "node-a", port, url), node_config(tmp_path, "node-b", port, url)
    a = start(a_cfg, tmp_path / "a.out")
    b = start(b_cfg, tmp_path / "b.out")
    b2 = None
    try:
        wait_for(
            lambda: any(j["world_size"] == 2 for j in lines(tmp_path / "loss.jsonl")),
            120,
            "the two nodes never trained together",
        )
        wait_for(
            lambda: any(
                e.get("outcome") == "committed" and e["step"] >= 8
                for n in ("node-a", "node-b")
                for e in events(tmp_path, n, "durable_committed")
            ),
            120,
            "no durable commit of both nodes' parts",
        )
        b.kill()
        b.wait(timeout=10)
        shutil.rmtree(tmp_path / "node-b" / "ckpt")  # a new machine: its fast tier is gone
        b2 = start(b_cfg, tmp_path / "b2.out")
        assert a.wait(timeout=240) == 0, (tmp_path / "a.out").read_text()[-3000:] + hangs(tmp_path)
        assert b2.wait(timeout=90) == 0, (tmp_path / "b2.out").read_text()[-3000:] + hangs(tmp_path)
    finally:
        for p in (a, b, b2):
            if p is not None:
                kill_tree(p.pid)
    multinode.assert_every_step_once_in_order(tmp_path / "loss.jsonl")
    assert not hangs(tmp_path), hangs(tmp_path)
    # One commit per step in the store, whichever node made it; both nodes uploaded parts.
    committed = [e for n in ("node-a", "node-b") for e in events(tmp_path, n, "durable_committed")]
    commits = collections.Counter(e["step"] for e in committed if e["outcome"] == "committed")
    assert commits and max(commits.values()) == 1, commits
    went = ("durable_part_uploaded", "durable_committed")
    parts = {n: {e["step"] for name in went for e in events(tmp_path, n, name)} for n in ("node-a", "node-b")}
    assert parts["node-a"] and parts["node-b"], parts
    # Every node uploads what rank 0's node picked (another node sends a part only for a step that node picked), so
    # the steps first sent once node B had rejoined are committed, the final one among them; not every one of them
    # (the uploader goes newest first, and a loaded host's scans pass over some, the last ones before the job's end
    # may not see one).
    rejoined = events(tmp_path, "node-b", "supervisor_started")[-1]["timestamp"]
    first: dict[int, str] = {}
    for n in ("node-a", "node-b"):
        for e in events(tmp_path, n, "durable_upload_started"):
            first[e["step"]] = min(first.get(e["step"], e["timestamp"]), e["timestamp"])
    after = {step for step, when in first.items() if when > rejoined}
    assert len(after & set(commits)) >= 2 and STEPS in commits, (sorted(commits), first, rejoined)
    with durable.open_tier(url) as tier:
        listed = tier.list_checkpoints()
    # A node sent, after the rejoin, a periodic step of which it was not the leader (the node of rank 0 in that
    # step's manifest, which rendezvous may move between attempts) only once its leader had picked (sent) it too.
    # Node A's fast tier, never wiped, has every step's manifest.
    followed = 0
    for node, other in (("node-a", "node-b"), ("node-b", "node-a")):
        picked = {e["step"] for e in events(tmp_path, other, "durable_upload_started")}
        for e in events(tmp_path, node, "durable_upload_started"):
            manifest = read_manifest(tmp_path / "node-a" / "ckpt" / f"step-{e['step']:09d}")
            led = node_of_rank(manifest.nodes or {}, 0)
            if e["timestamp"] > rejoined and manifest.kind == "periodic" and led == other:
                assert e["step"] in picked, (node, e["step"], sorted(picked))
                followed += 1
    assert followed, "no node sent a step another node led"
    # The store holds every step a node logged committed. A step committed without its event can only be one node B
    # had in hand when it was SIGKILLed: a commit is logged on the supervisor's next poll, after the store has it.
    stored = {c.step for c in listed.checkpoints}
    killed_with = {
        e["step"]
        for name in ("durable_upload_started", "durable_part_uploaded")
        for e in events(tmp_path, "node-b", name)
        if e["timestamp"] < rejoined
    }
    assert set(commits) <= stored and stored - set(commits) <= killed_with, (sorted(stored), sorted(killed_with))
    assert all(c.consistent for c in listed.checkpoints)
    # Node B's rank, on its new fast tier, read its share of the checkpoint it resumed from from the store.
    b_reads = [r for r in node_reads(tmp_path / "node-b") if r.get("durable_files", 0) > 0]
    assert b_reads, node_reads(tmp_path)
    assert all(re.search(r"node-b/ckpt/step-\d+$", r["path"]) for r in b_reads)
