"""The checkpoint engine where each node keeps its own checkpoint directory: real ranks (torchrun, gloo, CPU), each
rank a node of its own (`trainer/checkpoint/commit.py`, `noderead.py`), the durable tier a real S3 store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ftsup.store import durable, layout, nodes
from ftsup.store.durable import s3nodes
from tests.helpers import node_read_events
from tests.procs import torchrun

pytestmark = pytest.mark.multiprocess


def _run(mode: str, ckpt: Path, out: Path, *extra: str) -> tuple[dict, str]:
    r = torchrun("ckpt_worker.py", [mode, "--dir", str(ckpt), "--out", str(out), "--node-local", *extra], nproc=2)
    assert r.returncode == 0, r.output[-4000:]
    return json.loads(out.read_text()), r.output


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("nodes")
    return base / "ckpt", _run("save", base / "ckpt", base / "save.json", "--steps", "1,2")[0]


def _node_reads(output: str) -> dict[int, tuple[int, int]]:
    """rank -> (files read from its node's copy, files read from the durable tier), from the ranks' log."""
    return {e["rank"]: (e["local_files"], e["durable_files"]) for e in node_read_events(output)}


def _durable_copy(saved: tuple[Path, dict], tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The saved stores copied, their step 2 committed in the bucket (each node's part), the ranks told of it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[0], ckpt)
    url = f"s3://{bucket}/job"
    with durable.open_tier(url) as tier:
        with pytest.raises(s3nodes.WaitingForNodes):
            tier.upload(ckpt / "node-0" / layout.step_dirname(2), node="node-0")
        assert tier.upload(ckpt / "node-1" / layout.step_dirname(2), node="node-1").outcome == "committed"
    monkeypatch.setenv("FTSUP_CHECKPOINT_DURABLE", url)
    return ckpt


def test_every_node_commits_the_same_manifest_naming_which_node_holds_which_ranks(saved: tuple[Path, dict]) -> None:
    ckpt, _ = saved
    raws = {n: (ckpt / n / layout.step_dirname(2) / layout.MANIFEST_NAME).read_bytes() for n in ("node-0", "node-1")}
    assert raws["node-0"] == raws["node-1"]
    assert layout.parse_manifest(raws["node-0"]).nodes == {"node-0": (0,), "node-1": (1,)}


def test_each_node_holds_its_own_ranks_files_and_its_copy_is_consistent(saved: tuple[Path, dict]) -> None:
    ckpt, _ = saved
    copy = ckpt / "node-1" / layout.step_dirname(2)
    names = {p.name for p in copy.iterdir()}
    assert layout.shard_name(1) in names and layout.shard_name(0) not in names
    assert nodes.NODE_FILE in names and layout.DCP_META_NAME in names
    assert layout.inspect_checkpoint(copy, deep=True).consistent


def test_each_rank_reads_its_nodes_files_locally_and_the_others_from_the_store_bitwise(
    saved: tuple[Path, dict], tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _durable_copy(saved, tmp_path, bucket, monkeypatch)
    loaded, output = _run("load", ckpt, tmp_path / "load.json")
    assert (loaded["step"], loaded["digests"]) == (2, saved[1]["digests_2"])
    reads = _node_reads(output)
    assert sorted(reads) == [0, 1] and all(local > 0 for local, _ in reads.values()), (reads, output[-6000:])


def test_a_node_that_lost_its_fast_tier_reads_its_share_from_the_store_bitwise(
    saved: tuple[Path, dict], tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _durable_copy(saved, tmp_path, bucket, monkeypatch)
    shutil.rmtree(ckpt / "node-1")  # a new machine
    loaded, output = _run("load", ckpt, tmp_path / "load.json")
    assert (loaded["step"], loaded["digests"]) == (2, saved[1]["digests_2"])
    reads = _node_reads(output)
    assert sorted(reads) == [0, 1], (reads, output[-6000:])
    assert reads[1][0] == 0 and reads[1][1] > 0 and reads[0][0] > 0, reads


def test_a_node_killed_after_staging_its_copy_leaves_the_step_committed_on_no_node(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save = ["save", "--dir", str(ckpt), "--steps", "1,2", "--node-local", "--kill-at", "manifest_written:2:1"]
    r = torchrun("ckpt_worker.py", [*save, "--out", str(tmp_path / "s.json")], nproc=2)
    assert r.returncode != 0
    for node in ("node-0", "node-1"):
        assert [i.step for i in layout.list_checkpoints(ckpt / node, deep=True) if i.consistent] == [1], node
        assert [s for s, _ in layout.committed_dirs(ckpt / node)] == [1], node
