"""Retention: which checkpoints go, deleting them without tearing one, and recycling their shard files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ftsup.protocol import KEEP_OLDER_THAN_STEPS_ENV
from ftsup.store import layout, pins, retention
from ftsup.store.errors import CheckpointError
from tests.helpers import default_files, make_fake_checkpoint

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
    monkeypatch.setattr(retention, "_spares", lambda pool_fd: list(listed))
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


SPARE_NAME = "step-000000100.deleting-7-shard-00000.safetensors"


def test_only_plain_files_of_ours_are_claimed_and_the_rest_is_left_alone(tmp_path: Path) -> None:
    pool = tmp_path / RECYCLE
    pool.mkdir()
    (tmp_path / "elsewhere").write_bytes(b"not ours")
    (pool / SPARE_NAME.replace("00000", "00001")).mkdir()
    (pool / SPARE_NAME.replace("00000", "00002")).symlink_to(tmp_path / "elsewhere")
    os.link(tmp_path / "elsewhere", pool / SPARE_NAME.replace("00000", "00003"))
    (pool / "planted-file").write_bytes(b"someone's")
    (pool / SPARE_NAME).write_bytes(b"spare")
    assert retention.claim_spare(tmp_path, tmp_path / "dest") is True
    assert (tmp_path / "dest").read_bytes() == b"spare"
    assert retention.claim_spare(tmp_path, tmp_path / "dest2") is False
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1))
    assert len(_pool(tmp_path)) == 4  # nothing retention did not put there is trimmed
    assert (tmp_path / "elsewhere").read_bytes() == b"not ours"


# --------------------------------------------------------------------------- hostile stores


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.safetensors").write_bytes(b"precious")
    (victim / "notes.txt").write_bytes(b"notes")
    return victim


def _tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_pool_that_is_a_symlink_is_never_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / RECYCLE).symlink_to(victim)
    for step in (1, 2, 3):
        make_fake_checkpoint(ckpt, step, default_files(step))
    retention.apply_retention(ckpt, retention.RetentionPolicy(keep_last=1), spares=2)
    assert retention.claim_spare(ckpt, ckpt / "claimed") is False
    retention.apply_retention(ckpt, retention.RetentionPolicy(keep_last=1))
    assert _tree(victim) == {"notes.txt": b"notes", "precious.safetensors": b"precious"}
    assert sorted(p.name for p in ckpt.iterdir()) == [RECYCLE, "step-000000003"]  # deletion went on


def test_a_checkpoint_swapped_for_a_symlink_is_never_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):
        make_fake_checkpoint(ckpt, step, default_files(step))
    (ckpt / ".step-000000000.deleting-1").symlink_to(victim)  # looks like an interrupted deletion
    (ckpt / "step-000000001.partial").symlink_to(victim)  # looks like a stale partial
    retention.apply_retention(ckpt, retention.RetentionPolicy(keep_last=1), running_step=5, spares=2)
    assert _tree(victim) == {"notes.txt": b"notes", "precious.safetensors": b"precious"}
    assert (ckpt / "step-000000001.partial").is_symlink()  # not ours: left alone


def test_a_pool_owned_by_another_user_is_not_used(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    ckpt = tmp_path / "ckpt"
    (ckpt / RECYCLE).mkdir(parents=True)
    os.chown(ckpt / RECYCLE, 65534, 65534)
    for step in (1, 2):
        make_fake_checkpoint(ckpt, step, default_files(step))
    retention.apply_retention(ckpt, retention.RetentionPolicy(keep_last=1), spares=2)
    assert _pool(ckpt) == []  # its owner could swap our spares for links to anything


def test_planted_newer_checkpoints_never_push_the_runs_own_out(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    make_fake_checkpoint(tmp_path, 999_999_999_999, default_files(1))  # planted, or another run's
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=2), protect={30})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000020", "step-000000030", "step-999999999999"]


def test_a_non_canonical_name_is_deleted_by_the_name_found(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 5, default_files(5))
    odd = make_fake_checkpoint(tmp_path, 8, default_files(8))
    odd.rename(tmp_path / "step-0000000008")  # 10 digits: not a name ftsup writes, but a step-N name
    make_fake_checkpoint(tmp_path, 9, default_files(9))
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), protect={9})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000009"]


# --------------------------------------------------------------------------- history and pins


def _steps(root: Path) -> list[int]:
    return [s for s, _ in layout.committed_dirs(root)]


def test_history_keeps_the_newest_checkpoint_at_least_that_many_steps_older_than_the_latest_and_all_younger() -> None:
    steps = [(s, True) for s in range(10, 110, 10)]
    policy = retention.RetentionPolicy(keep_last=1, keep_older_than_steps=35)
    assert retention.retention_victims(steps, policy) == [10, 20, 30, 40, 50]


def test_history_holds_at_every_step_of_a_run() -> None:
    policy = retention.RetentionPolicy(keep_last=2, keep_older_than_steps=5)
    kept: list[int] = []
    oldest_enough = []
    for step in range(1, 31):
        kept.append(step)
        kept = [s for s in kept if s not in retention.retention_victims(((s, True) for s in kept), policy)]
        oldest_enough.append(max((s for s in kept if s <= step - 5), default=None))
    assert oldest_enough == [None] * 5 + list(range(1, 26))


def test_history_of_zero_keeps_nothing_extra() -> None:
    steps = [(s, True) for s in range(10, 60, 10)]
    assert retention.retention_victims(steps, retention.RetentionPolicy(keep_last=2)) == [10, 20, 30]


def test_history_counts_from_the_latest_consistent_checkpoint() -> None:
    steps = [(10, True), (20, True), (30, True), (40, True), (50, False)]
    policy = retention.RetentionPolicy(keep_last=1, keep_older_than_steps=25)
    assert retention.retention_victims(steps, policy) == []  # from 50 it would have let 10 go


def test_pinned_steps_are_never_victims() -> None:
    steps = [(s, True) for s in (100, 200, 300, 400)]
    policy = retention.RetentionPolicy(keep_last=1)
    assert retention.retention_victims(steps, policy, pinned=[100, 300]) == [200]


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_a_bad_history_is_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(CheckpointError, match="keep_older_than_steps must be an integer >= 0"):
        retention.RetentionPolicy(keep_older_than_steps=value)


def test_the_environment_sets_a_floor_under_the_history() -> None:
    env = {KEEP_OLDER_THAN_STEPS_ENV: "50"}
    got = [
        retention.RetentionPolicy(keep_older_than_steps=k).with_environment(env).keep_older_than_steps for k in (0, 80)
    ]
    assert got == [50, 80]


def test_an_empty_environment_variable_changes_nothing() -> None:
    policy = retention.RetentionPolicy(keep_last=4)
    assert policy.with_environment({KEEP_OLDER_THAN_STEPS_ENV: ""}) == policy


@pytest.mark.parametrize("raw", ["-1", "ten", "1e3", "٣", "9" * 19])
def test_a_bad_environment_value_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(CheckpointError, match=f"environment variable {KEEP_OLDER_THAN_STEPS_ENV}="):
        retention.RetentionPolicy().with_environment({KEEP_OLDER_THAN_STEPS_ENV: raw})


def test_apply_retention_never_deletes_a_pinned_checkpoint(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    pins.pin(tmp_path, 10, who="op", reason="", now=1.0)
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), protect={40})
    assert _steps(tmp_path) == [10, 40]


def test_apply_retention_keeps_the_checkpoint_of_a_bad_pin_file(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    (tmp_path / pins.PINS_DIRNAME).mkdir()
    (tmp_path / pins.PINS_DIRNAME / pins.pin_name(20)).write_text("garbage")
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), protect={30})
    assert _steps(tmp_path) == [20, 30]


def test_unreadable_pins_delete_nothing_and_say_why(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    (tmp_path / pins.PINS_DIRNAME).write_text("a file, not a directory")
    with pytest.raises(CheckpointError, match="no checkpoint is deleted until the pins can be read"):
        retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), protect={30})
    assert _steps(tmp_path) == [10, 20, 30]


def test_a_pin_written_after_the_victims_were_chosen_still_keeps_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (10, 20, 30):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    choose = retention.retention_victims

    def then_an_operator_pins(*args: Any, **kwargs: Any) -> list[int]:
        victims = choose(*args, **kwargs)
        pins.pin(tmp_path, 10, who="op", reason="", now=1.0)
        return victims

    monkeypatch.setattr(retention, "retention_victims", then_an_operator_pins)
    retention.apply_retention(tmp_path, retention.RetentionPolicy(keep_last=1), protect={30})
    assert _steps(tmp_path) == [10, 30]


def test_apply_retention_keeps_the_history_the_policy_asks_for(tmp_path: Path) -> None:
    for step in range(1, 11):
        make_fake_checkpoint(tmp_path, step, default_files(step))
    policy = retention.RetentionPolicy(keep_last=2, keep_older_than_steps=4)
    retention.apply_retention(tmp_path, policy, protect={10})
    assert _steps(tmp_path) == [6, 7, 8, 9, 10]
