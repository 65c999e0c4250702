"""The checkpoint engine across real ranks: torchrun, gloo, CPU.

One FSDP2 checkpoint saved on 2 ranks is shared by the resharding tests (torchrun costs
seconds); each fault test makes its own directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftsup.store import layout
from tests.procs import torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


def _save(ckpt: Path, out: Path, *extra: str, nproc: int = 2, parallel: str = "fsdp") -> dict:
    r = torchrun(
        "ckpt_worker.py", ["save", "--dir", str(ckpt), "--parallel", parallel, "--out", str(out), *extra], nproc=nproc
    )
    assert r.returncode == 0, r.output[-4000:]
    return json.loads(out.read_text())


def _load(ckpt: Path, out: Path, *extra: str, nproc: int, parallel: str = "fsdp") -> dict:
    r = torchrun(
        "ckpt_worker.py", ["load", "--dir", str(ckpt), "--parallel", parallel, "--out", str(out), *extra], nproc=nproc
    )
    assert r.returncode == 0, r.output[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fsdp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("fsdp")
    saved = _save(base / "ckpt", base / "save.json", "--steps", "1,2", "--async", "--train-during", "3")
    return base / "ckpt", saved


@pytest.mark.parametrize("nproc", [1, 3])  # on 2 ranks: the test after the next one
def test_fsdp_saved_on_2_ranks_loads_bitwise_on_n_ranks(fsdp_ckpt, tmp_path, nproc):
    ckpt, saved = fsdp_ckpt
    loaded = _load(ckpt, tmp_path / "load.json", nproc=nproc)
    assert (loaded["step"], loaded["saved_world_size"]) == (2, 2)
    assert loaded["digests"] == saved["digests_2"]


def test_async_save_holds_the_state_at_the_call_while_training_goes_on(fsdp_ckpt):
    _, saved = fsdp_ckpt
    assert saved["trained_during"] == 3
    assert saved["digests_after_2"] != saved["digests_2"]  # training changed the weights during the write


def test_rank_state_and_metadata_travel_with_the_checkpoint_loaded_bitwise_on_2_ranks(fsdp_ckpt, tmp_path):
    ckpt, saved = fsdp_ckpt
    loaded = _load(ckpt, tmp_path / "load.json", "--step", "1", nproc=2)
    assert (loaded["step"], loaded["rank_state"], loaded["metadata"], loaded["saved_world_size"]) == (
        1,
        {"rank": 0, "step": 1},
        {"global_batch": 8},
        2,
    )
    assert loaded["digests"] == saved["digests_1"]


def test_ddp_saved_on_2_ranks_loads_on_3_ranks_and_writes_replicas_once(tmp_path):
    saved = _save(tmp_path / "ckpt", tmp_path / "save.json", "--steps", "2", "--width", "256", parallel="ddp")
    loaded = _load(tmp_path / "ckpt", tmp_path / "load.json", "--width", "256", nproc=3, parallel="ddp")
    assert loaded["digests"] == saved["digests_2"]
    manifest = layout.read_manifest(tmp_path / "ckpt" / layout.step_dirname(2))
    shards = sorted(e.size for p, e in manifest.files.items() if p.endswith(".safetensors"))
    # Replicated DDP tensors are written once in total, spread across both ranks by bytes.
    assert shards[0] > 0.4 * shards[1]
    # params + 2 Adam moments, once; plus one 4-byte `step` per parameter tensor
    total = 4 * 3 * (16 * 256 + 256 + 256 * 256 + 256 + 256 * 4 + 4) + 4 * 6
    assert manifest.tensor_bytes == total


def test_process_group_none_under_torch_distributed_means_all_ranks(tmp_path):
    # Not a single-process engine per rank: those would all write shard-00000 into one checkpoint.
    saved = _save(tmp_path / "ckpt", tmp_path / "save.json", "--steps", "1", "--process-group", "none")
    loaded = _load(tmp_path / "ckpt", tmp_path / "load.json", nproc=2)
    manifest = layout.read_manifest(tmp_path / "ckpt" / layout.step_dirname(1))
    shards = sorted(p for p in manifest.files if p.endswith(".safetensors"))
    assert (manifest.world_size, shards, loaded["digests"] == saved["digests_1"]) == (
        2,
        ["shard-00000.safetensors", "shard-00001.safetensors"],
        True,
    )


KILL_POINTS = [
    ("staged", 1),  # a rank dies right after staging, before writing
    ("shard_written", 1),  # a rank dies after writing its shard, before the commit
    ("metadata_written", 0),  # the coordinator dies before the manifest
    ("manifest_written", 0),  # ... after the manifest, before the rename
    ("renamed", 0),  # ... right after the rename
]


@pytest.fixture(scope="module")
def torn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each kill point's save of steps 1 and 2 on 2 ranks, SIGKILLed there in step 2's save, in a store of its own;
    then one next save (step 3) into every store."""
    got: dict[str, dict] = {}
    for point, rank in KILL_POINTS:
        ckpt = tmp_path_factory.mktemp(f"torn-{point}") / "ckpt"
        save = ["save", "--dir", str(ckpt), "--steps", "1,2", "--kill-at", f"{point}:2:{rank}"]
        r = torchrun("ckpt_worker.py", [*save, "--out", str(ckpt.parent / "s.json")], nproc=2)
        latest = layout.latest_consistent(ckpt, deep=True)
        listed = [i.step for i in layout.list_checkpoints(ckpt)]
        got[point] = {"ckpt": ckpt, "code": r.returncode, "latest": latest and latest.step, "listed": listed}
    first, *others = (got[point]["ckpt"] for point, _ in KILL_POINTS)
    also = [a for ckpt in others for a in ("--also-dir", str(ckpt))]
    _save(first, first.parent / "s2.json", "--steps", "3", *also)
    return got


@pytest.mark.parametrize(("point", "rank"), KILL_POINTS)
def test_sigkill_during_a_save_never_tears_the_latest_checkpoint(torn, point, rank):
    committed = point == "renamed"
    t = torn[point]
    assert (t["code"] != 0, t["latest"], t["listed"]) == (True, 2 if committed else 1, [1, 2] if committed else [1])
    # The next save succeeds (and cleans the torn .partial).
    assert layout.latest_consistent(t["ckpt"], deep=True).step == 3
    assert not list(t["ckpt"].glob("*.partial"))
