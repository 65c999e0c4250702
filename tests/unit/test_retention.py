"""Retention: which checkpoints go, deleting them without tearing one, and recycling their shard files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import default_files, make_fake_checkpoint
from trainer.checkpoint import retention
from trainer.checkpoint.errors import CheckpointError

RECYCLE = retention.RECYCLE_DIRNAME


def test_retention_keeps_the_last_k_consistent() -> None:
    steps = [(s, True) for s in (100, 200, 300, 400, 500)]
    policy = retention.RetentionPolicy(keep_last=2)
    assert retention.retention_victims(steps, policy) == [100, 200, 300]


def test_retention_keeps_every_nth_step() -> None:
    steps = [(s, True) for s in (100, 200, 300, 400, 500)]
    policy = retention.RetentionPolicy(keep_last=1, keep_every=200)
    assert retention.retention_victims(steps, policy) == [100, 300]


def test_retention_keeps_protected_steps() -> None:
    steps = [(s, True) for s in (100, 200, 300)]
    policy = retention.RetentionPolicy(keep_last=1)
    assert retention.retention_victims(steps, policy, protect=[100]) == [200]


def test_retention_leaves_inconsistent_checkpoints_alone() -> None:
    steps = [(100, False), (200, True), (300, False), (400, True)]
    policy = retention.RetentionPolicy(keep_last=1)
    assert retention.retention_victims(steps, policy) == [200]


def test_retention_never_deletes_the_newest_consistent_even_if_newer_ones_are_broken() -> None:
    steps = [(100, True), (200, True), (300, False), (400, False)]
    policy = retention.RetentionPolicy(keep_last=1)
    assert retention.retention_victims(steps, policy) == [100]


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": 0}, {"keep_last": 1.5}])
def test_retention_policy_refuses_values_that_would_delete_everything(
    kwargs: dict[str, Any],
) -> None:
    with pytest.raises(CheckpointError, match="retention keep_"):
        retention.RetentionPolicy(**kwargs)


def test_apply_retention_deletes_victims_and_keeps_the_rest(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        make_fake_checkpoint(tmp_path, step, {"a.bin": b"a"})
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000200", "step-000000300"]


def test_apply_retention_removes_only_partials_older_than_the_running_save(
    tmp_path: Path,
) -> None:
    make_fake_checkpoint(tmp_path, 100, {"a.bin": b"a"})
    for step in (50, 150, 200, 250):
        make_fake_checkpoint(tmp_path, step, {"a.bin": b"a"}, partial=True, manifest=False)
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), running_step=200)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000100",
        "step-000000200.partial",
        "step-000000250.partial",
    ]


def test_apply_retention_without_a_running_save_keeps_partials(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 100, {"a.bin": b"a"}, partial=True, manifest=False)
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1))
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000100.partial"]


def test_apply_retention_finishes_an_interrupted_deletion(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 100, {"a.bin": b"a"})
    (tmp_path / ".step-000000050.deleting-12345").mkdir()
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1))
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000100"]


# --------------------------------------------------------------------------- recycling


def _pool(root: Path) -> list[str]:
    pool = root / RECYCLE
    return sorted(os.listdir(pool)) if pool.is_dir() else []


def test_deleted_checkpoints_leave_their_shard_files_as_spares_up_to_the_limit(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    inode = (tmp_path / "step-000000100" / "shard-00000.safetensors").stat().st_ino
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), spares=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECYCLE, "step-000000300"]
    spares = _pool(tmp_path)
    assert len(spares) == 2 and all(n.endswith(".safetensors") for n in spares)  # never the rank state
    assert inode in {(tmp_path / RECYCLE / n).stat().st_ino for n in spares}  # moved, not copied


def test_without_spares_the_pool_is_emptied(tmp_path: Path) -> None:
    for step in (100, 200):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), spares=2)
    assert len(_pool(tmp_path)) == 2
    make_fake_checkpoint(tmp_path, 300, default_files(300))
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), spares=1)
    assert len(_pool(tmp_path)) == 1  # a smaller world size needs fewer
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1))
    assert _pool(tmp_path) == []


def test_a_spare_is_claimed_once_and_the_pool_runs_dry(tmp_path: Path) -> None:
    for step in (100, 200):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), spares=2)
    dests = [tmp_path / f"claimed-{i}" for i in range(3)]
    assert [retention.claim_spare(tmp_path, d) for d in dests] == [True, True, False]
    assert dests[0].stat().st_ino != dests[1].stat().st_ino
    assert _pool(tmp_path) == []


def test_a_spare_taken_by_another_rank_meanwhile_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (100, 200):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), spares=2)
    first, second = _pool(tmp_path)
    listed = [first, second]
    os.rename(tmp_path / RECYCLE / first, tmp_path / "taken-by-another-rank")  # after this rank listed
    monkeypatch.setattr(retention, "_pool_files", lambda pool: list(listed))
    assert retention.claim_spare(tmp_path, tmp_path / "mine")
    assert (tmp_path / "mine").stat().st_ino != (tmp_path / "taken-by-another-rank").stat().st_ino
    assert not (tmp_path / RECYCLE / second).exists()


def test_without_a_pool_there_is_nothing_to_claim(tmp_path: Path) -> None:
    assert retention.claim_spare(tmp_path, tmp_path / "dest") is False
    assert not (tmp_path / "dest").exists()


def test_something_else_named_like_the_pool_never_stops_deletion(tmp_path: Path) -> None:
    (tmp_path / RECYCLE).write_bytes(b"not a directory")
    for step in (100, 200):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), spares=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECYCLE, "step-000000200"]
    assert retention.claim_spare(tmp_path, tmp_path / "dest") is False


def test_only_plain_files_are_claimed_and_the_rest_is_trimmed(tmp_path: Path) -> None:
    pool = tmp_path / RECYCLE
    (pool / "a-directory").mkdir(parents=True)
    (pool / "b-link").symlink_to(tmp_path / "elsewhere")
    (pool / "c-file").write_bytes(b"spare")
    assert retention.claim_spare(tmp_path, tmp_path / "dest") is True
    assert (tmp_path / "dest").read_bytes() == b"spare"
    assert retention.claim_spare(tmp_path, tmp_path / "dest2") is False
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1))
    assert _pool(tmp_path) == []
