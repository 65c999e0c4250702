"""The memory tier's peers, real ranks (torchrun, gloo, CPU), each rank a node of its own with its own disk and
memory directories and no durable tier (`trainer/checkpoint/peers.py`, `peerload.py`): each node's part is replicated
to the other's memory; a node lost whole is restored from it bitwise; a replica with a flipped byte or torn is never
read, the part comes from the next copy, and the choice is logged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ftsup.store import layout, nodes
from tests.procs import torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

REPLICA = Path("peers") / "node-1" / layout.step_dirname(2) / layout.shard_name(1)


def _run(mode: str, base: Path, out: Path, nproc: int = 2) -> tuple[dict, str]:
    args = [mode, "--dir", str(base / "ckpt"), "--memory", str(base / "mem"), "--out", str(out), "--node-local"]
    r = torchrun("ckpt_worker.py", [*args, "--steps", "1,2"] if mode == "save" else args, nproc=nproc)
    assert r.returncode == 0, r.output[-4000:]
    return json.loads(out.read_text()), r.output


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("peers")
    return base, _run("save", base, base / "save.json")[0]


@pytest.fixture
def copy(saved: tuple[Path, dict], tmp_path: Path) -> Path:
    for name in ("ckpt", "mem"):
        shutil.copytree(saved[0] / name, tmp_path / name)
    return tmp_path


def _events(output: str, name: str) -> list[str]:
    return [line for line in output.splitlines() if name in line]


def test_a_save_reaches_memory_and_the_peers_and_each_node_holds_the_others_part(saved: tuple[Path, dict]) -> None:
    base, result = saved
    assert result["tiers_2"] == ["memory", "peers"]
    for node, other in (("node-0", "node-1"), ("node-1", "node-0")):
        replica = base / "mem" / node / "peers" / other / layout.step_dirname(2)
        assert layout.inspect_checkpoint(replica, deep=True).consistent, replica
        own = base / "mem" / node / layout.step_dirname(2)
        assert layout.read_manifest(replica) == layout.read_manifest(own)


@pytest.fixture(scope="module")
def lost(saved: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """Node 1 lost whole (its disk and its memory) and the job loaded again: the copy it left, what the load said."""
    base = tmp_path_factory.mktemp("lost")
    for name in ("ckpt", "mem"):
        shutil.copytree(saved[0] / name, base / name)
    shutil.rmtree(base / "ckpt" / "node-1")
    shutil.rmtree(base / "mem" / "node-1")
    loaded, output = _run("load", base, base / "load.json")
    return base, loaded, output


def test_a_node_lost_whole_is_restored_from_its_peers_memory_bitwise(
    saved: tuple[Path, dict], lost: tuple[Path, dict, str]
) -> None:
    base, loaded, _ = lost
    assert (loaded["step"], loaded["digests"], loaded["tiers"]) == (2, saved[1]["digests_2"], ["peers", "peers"])
    assert not (base / "mem" / "node-0" / "restore").exists()  # the copy a load reads goes with it


def test_a_node_lost_whole_receives_the_files_its_rank_reads_not_the_whole_checkpoint(
    lost: tuple[Path, dict, str],
) -> None:
    base, _, output = lost
    [restored] = [e for e in _events(output, "checkpoint_peer_restored") if "node=node-1" in e]
    got = dict(kv.split("=", 1) for kv in restored.split() if kv.split("=", 1)[0].endswith("_bytes"))
    manifest = layout.read_manifest(base / "mem" / "node-0" / layout.step_dirname(2))
    # The saved FSDP shards: rank 1's load reads its own shard (and, as every rank, the files of every node), none of
    # node 0's; before, the whole checkpoint moved.
    own = sum(manifest.files[rel].size for rel in nodes.held_by(manifest.files, manifest.nodes or {}, "node-1"))
    whole = sum(e.size for e in manifest.files.values())
    assert (int(got["received_bytes"]), int(got["checkpoint_bytes"])) == (own, whole), restored
    assert own < whole * 0.6
    # Its shard, read by its rank alone, is loaded as received, not written into the copy and read back.
    assert int(got["kept_bytes"]) == manifest.files[layout.shard_name(1)].size, restored


def test_the_node_left_alone_after_a_loss_resumes_from_the_replica_in_its_own_memory_bitwise(
    saved: tuple[Path, dict], copy: Path
) -> None:
    # Node 1 lost whole and the job shrunk to node 0 (one rank, one node: no ring): node 1's part is only in the
    # replica node 0's memory holds, and the load reads it from there (its disk's copy lacks that part).
    shutil.rmtree(copy / "ckpt" / "node-1")
    shutil.rmtree(copy / "mem" / "node-1")
    loaded, output = _run("load", copy, copy / "load.json", nproc=1)
    assert (loaded["step"], loaded["digests"], loaded["tiers"]) == (2, saved[1]["digests_2"], ["peers"])
    [restored] = _events(output, "checkpoint_peer_restored")
    assert "node=node-0" in restored and "received_bytes=0" in restored, restored


@pytest.mark.parametrize("damage", ["flip", "tear"])
def test_a_damaged_replica_is_never_read_and_the_next_copy_is_logged(
    saved: tuple[Path, dict], copy: Path, damage: str
) -> None:
    shard = copy / "mem" / "node-0" / REPLICA
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x10
    shard.write_bytes(data if damage == "flip" else data[: len(data) // 2])
    shutil.rmtree(copy / "mem" / "node-1")  # node-1's memory gone; its disk holds its part
    loaded, output = _run("load", copy, copy / "load.json")
    assert (loaded["step"], loaded["digests"]) == (2, saved[1]["digests_2"])
    assert any("step=2" in e and "tier=peers" in e for e in _events(output, "checkpoint_peer_copy_skipped")), output
    restored = _events(output, "checkpoint_peer_restored")
    assert any("node=node-1" in e and "'node-1': 'disk" in e for e in restored), restored


def test_with_its_only_replica_damaged_a_lost_node_resumes_from_the_older_step_all_hold(
    saved: tuple[Path, dict], copy: Path
) -> None:
    shard = copy / "mem" / "node-0" / REPLICA
    shard.write_bytes(shard.read_bytes()[:100])
    shutil.rmtree(copy / "ckpt" / "node-1")
    shutil.rmtree(copy / "mem" / "node-1")
    loaded, _ = _run("load", copy, copy / "load.json")
    assert (loaded["step"], loaded["digests"]) == (1, saved[1]["digests_1"])


def test_a_flipped_byte_in_a_replica_file_only_sent_is_refused_on_arrival_and_the_older_step_is_loaded(
    saved: tuple[Path, dict], copy: Path
) -> None:
    # Rank 1's state is read by rank 1 alone: node 0 sends it from its replica and links none of it, so only the
    # receiver's check finds the flip (the offer makes no deep check); the plan made again goes without that copy.
    state = copy / "mem" / "node-0" / REPLICA.parent / layout.rank_state_name(1)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(data)
    shutil.rmtree(copy / "ckpt" / "node-1")
    shutil.rmtree(copy / "mem" / "node-1")
    loaded, output = _run("load", copy, copy / "load.json")
    assert (loaded["step"], loaded["digests"], loaded["rank_state"]) == (
        1,
        saved[1]["digests_1"],
        {"rank": 0, "step": 1},
    )
    [skipped] = _events(output, "checkpoint_peer_copy_skipped")
    assert "step=2" in skipped and "tier=peers" in skipped and "from group rank 0" in skipped, skipped
    assert layout.rank_state_name(1) in skipped, skipped
    assert any("step=1" in e and "node=node-1" in e for e in _events(output, "checkpoint_peer_restored")), output


def test_with_two_ranks_a_node_every_ranks_part_is_replicated_and_restored_bitwise(tmp_path: Path) -> None:
    def run(mode: str, *extra: str) -> dict:
        args = [mode, "--dir", str(tmp_path / "ckpt"), "--memory", str(tmp_path / "mem"), "--node-local", *extra]
        r = torchrun(
            "ckpt_worker.py", [*args, "--ranks-per-node", "2", "--out", str(tmp_path / f"{mode}.json")], nproc=4
        )
        assert r.returncode == 0, r.output[-4000:]
        return json.loads((tmp_path / f"{mode}.json").read_text())

    saved = run("save", "--steps", "1")
    replica = tmp_path / "mem" / "node-0" / "peers" / "node-1" / layout.step_dirname(1)
    assert {layout.shard_name(2), layout.shard_name(3)} <= {p.name for p in replica.iterdir()}
    shutil.rmtree(tmp_path / "ckpt" / "node-1")
    shutil.rmtree(tmp_path / "mem" / "node-1")
    loaded = run("load")
    assert (loaded["step"], loaded["digests"], loaded["tiers"]) == (1, saved["digests_1"], ["peers"] * 4)


def test_a_link_planted_for_the_replicas_is_never_written_through_and_the_save_stands(copy: Path) -> None:
    peers = copy / "mem" / "node-0" / "peers"
    elsewhere = copy / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(peers)
    peers.symlink_to(elsewhere)
    args = ["save", "--dir", str(copy / "ckpt"), "--memory", str(copy / "mem"), "--node-local", "--steps", "3"]
    r = torchrun("ckpt_worker.py", [*args, "--out", str(copy / "save.json")], nproc=2)
    assert r.returncode == 0, r.output[-4000:]
    assert json.loads((copy / "save.json").read_text())["tiers_3"] == ["memory"]
    assert list(elsewhere.iterdir()) == [] and "checkpoint_peer_replica_failed" in r.output
    assert [s for s, _ in layout.committed_dirs(copy / "ckpt" / "node-0")][-1] == 3
