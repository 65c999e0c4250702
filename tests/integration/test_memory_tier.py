"""The node's memory tier in one process: every save in both tiers, its own retention, loads from it when it holds
the checkpoint chosen, and never a torn, corrupt or linked copy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog

from ftsup import memtier, protocol
from ftsup.store import layout
from ftsup.trainer import runtime as runtime_module
from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointError, RetentionPolicy
from tests.helpers import flip_byte
from tests.integration.test_checkpoint_engine import bump, make_state, same, snapshot


def _engine(tmp_path: Path, keep_last: int = 1) -> CheckpointEngine:
    tier = memtier.MemoryTier(str(tmp_path / "shm" / "ftsup-test"), keep_last)
    return CheckpointEngine(tmp_path / "ckpt", retention=RetentionPolicy(keep_last=5), memory=tier)


def _steps(root: Path) -> list[int]:
    return [step for step, _ in layout.committed_dirs(root)]


def _saved_twice(tmp_path: Path) -> tuple[CheckpointEngine, dict]:
    """An engine that saved steps 1 and 2 (the state of step 2 returned)."""
    eng = _engine(tmp_path)
    state = make_state()
    eng.save(1, {"app": state}, block=True)
    bump(state)
    eng.save(2, {"app": state}, block=True)
    return eng, snapshot(state)


def test_a_save_lands_in_both_tiers_each_with_its_manifest_and_checksums(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    try:
        eng.save(3, {"app": make_state()}, block=True)
    finally:
        eng.close()
    for root in (tmp_path / "ckpt", tmp_path / "shm" / "ftsup-test"):
        step_dir = root / "step-000000003"
        _, problems = layout.check_checkpoint(step_dir, deep=True)
        manifest = layout.read_manifest(step_dir)
        assert (problems, manifest.step) == ([], 3)
        assert {"shard-00000.safetensors", "shard-00000.crc32", "dcp_metadata.json"} <= set(manifest.files)
    assert oct(os.stat(tmp_path / "shm" / "ftsup-test").st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("keep_last", [1, 2])
def test_the_memory_tier_keeps_its_newest_keep_last_and_the_store_its_own(tmp_path: Path, keep_last: int) -> None:
    eng = _engine(tmp_path, keep_last)
    try:
        for step in (1, 2, 3):
            eng.save(step, {"app": make_state()}, block=True)
    finally:
        eng.close()
    assert (_steps(tmp_path / "shm" / "ftsup-test"), _steps(tmp_path / "ckpt")) == ([1, 2, 3][-keep_last:], [1, 2, 3])


def test_a_load_reads_the_memory_tier_when_it_holds_the_newest_checkpoint(tmp_path: Path) -> None:
    eng, want = _saved_twice(tmp_path)
    try:
        fresh = make_state(seed=5)
        loaded = eng.load({"app": fresh})
    finally:
        eng.close()
    assert (loaded.step, loaded.tier, Path(loaded.path).parent) == (2, "memory", tmp_path / "shm" / "ftsup-test")
    assert same(snapshot(fresh), want)


def _flip(shard: Path) -> None:
    flip_byte(shard, shard.stat().st_size - 10)


def _tear(shard: Path) -> None:
    shard.unlink()


def _link(shard: Path) -> None:
    # the store's copy of the same bytes: a link is refused whatever it points at
    target = Path(str(shard).replace("shm/ftsup-test", "ckpt"))
    shard.unlink()
    shard.symlink_to(target)


@pytest.mark.parametrize("spoil", [_flip, _tear, _link], ids=["flipped byte", "torn", "symlink"])
def test_a_bad_copy_in_memory_is_never_loaded_the_stores_is(tmp_path: Path, spoil) -> None:
    eng, want = _saved_twice(tmp_path)
    spoil(tmp_path / "shm" / "ftsup-test" / "step-000000002" / "shard-00000.safetensors")
    try:
        fresh = make_state(seed=6)
        with structlog.testing.capture_logs() as logs:
            loaded = eng.load({"app": fresh})
    finally:
        eng.close()
    assert (loaded.step, loaded.tier, Path(loaded.path).parent) == (2, "fast", tmp_path / "ckpt")
    assert same(snapshot(fresh), want)
    passed = [e for e in logs if e["event"] == "checkpoint_memory_passed_over"]
    assert [(e["step"], "shard-00000" in e["reason"] or "missing" in e["reason"]) for e in passed] == [(2, True)]
    assert _steps(tmp_path / "ckpt") == [1, 2]  # the store's copies are never passed over for the memory's


def test_a_memory_tier_directory_that_is_a_link_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / "ftsup-test").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="ftsup-test is a link or not a directory"):
        _engine(tmp_path)
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize(
    "value",
    [
        "3:/dev/shm/x",
        "0:/dev/shm/x",
        "/dev/shm/x",
        "1:relative",
        "1:/dev/shm/../../etc",
        "1:/",
        "1:/a\x00b",
        "x" * 5000,
    ],
)
def test_a_hostile_memory_tier_variable_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match=f"environment variable {protocol.MEMORY_TIER_ENV}"):
        protocol.RuntimeEnv.from_environ({protocol.MEMORY_TIER_ENV: value})


def test_an_engine_told_of_a_hostile_memory_tier_refuses_to_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(runtime_module, "_client", None)
    monkeypatch.setenv(protocol.MEMORY_TIER_ENV, "1:../../etc")
    with pytest.raises(CheckpointError, match=protocol.MEMORY_TIER_ENV):
        CheckpointEngine(tmp_path / "ckpt")


def test_the_memory_tier_variable_is_read_as_the_supervisor_writes_it() -> None:
    tier = memtier.MemoryTier("/dev/shm/ftsup-run", 2)
    assert protocol.RuntimeEnv.from_environ({protocol.MEMORY_TIER_ENV: tier.encode()}).memory_tier == tier
