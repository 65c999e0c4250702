"""The resume choice across the fast tier and a durable one (`ftsup.store.tiers`), on a real local store and a real
durable tier on a shared filesystem (`durable_fs`), written by its own upload."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup.store import choice, durable, layout, tiers
from ftsup.store.errors import CheckpointCorruptError, NoCheckpointError
from tests.helpers import default_files, flip_byte, make_fake_checkpoint


@pytest.fixture
def fast(tmp_path: Path) -> Path:
    return tmp_path / "fast"


@pytest.fixture
def tier(tmp_path: Path) -> durable.DurableTier:
    return durable.open_tier(str(tmp_path / "durable"))


def durable_copy(tier: durable.DurableTier, tmp_path: Path, step: int) -> Path:
    """Checkpoint `step` committed in the durable tier (uploaded from a local store of its own); its path there."""
    tier.upload(make_fake_checkpoint(tmp_path / "elsewhere", step, default_files(step)))
    return Path(tier.step_url(step))


def across(fast: Path, tier: durable.DurableTier | None, *, at_most: int | None = None) -> tiers.TierChoice:
    return tiers.across(choice.choose(fast, at_most=at_most), tier, at_most=at_most)


def test_the_newest_checkpoint_of_either_tier_is_chosen(fast: Path, tier, tmp_path: Path) -> None:
    make_fake_checkpoint(fast, 10, default_files(10))
    durable_copy(tier, tmp_path, 10)
    durable_copy(tier, tmp_path, 20)
    got = across(fast, tier)
    assert (got.tier, got.step, got.info.path if got.info else None) == ("durable", 20, tier.step_url(20))
    assert got.durable is not None and got.durable.manifest.step == 20


def test_a_complete_local_copy_is_preferred_over_the_durable_copy_of_the_same_step(fast: Path, tier, tmp_path) -> None:
    local = make_fake_checkpoint(fast, 20, default_files(20))
    durable_copy(tier, tmp_path, 20)
    got = across(fast, tier)
    assert (got.tier, got.step, got.info.path if got.info else None) == ("fast", 20, str(local))


def test_a_newer_local_checkpoint_is_chosen_over_older_durable_ones(fast: Path, tier, tmp_path: Path) -> None:
    make_fake_checkpoint(fast, 30, default_files(30))
    durable_copy(tier, tmp_path, 20)
    assert (across(fast, tier).tier, across(fast, tier).step) == ("fast", 30)


def test_a_torn_local_copy_is_passed_over_and_the_durable_copy_of_its_step_is_chosen(fast, tier, tmp_path) -> None:
    make_fake_checkpoint(fast, 10, default_files(10))
    torn = make_fake_checkpoint(fast, 20, default_files(20))
    (torn / "shard-00000.safetensors").write_bytes(b"torn")
    durable_copy(tier, tmp_path, 20)
    got = across(fast, tier)
    assert (got.tier, got.step) == ("durable", 20)
    assert [(p.step, p.action) for p in got.passed] == [(20, choice.QUARANTINED)]


def test_a_durable_manifest_that_does_not_parse_is_never_chosen(fast: Path, tier, tmp_path: Path) -> None:
    make_fake_checkpoint(fast, 10, default_files(10))
    durable_copy(tier, tmp_path, 20)
    (durable_copy(tier, tmp_path, 30) / layout.MANIFEST_NAME).write_bytes(b'{"format_version": 1, "step": ')
    got = across(fast, tier)
    assert (got.tier, got.step) == ("durable", 20)
    assert [(p.step, p.action, p.path) for p in got.passed] == [(30, choice.SKIPPED, tier.step_url(30))]


def test_a_durable_checkpoint_missing_a_file_is_never_chosen(fast: Path, tier, tmp_path: Path) -> None:
    make_fake_checkpoint(fast, 10, default_files(10))
    (durable_copy(tier, tmp_path, 30) / "shard-00001.safetensors").unlink()
    got = across(fast, tier)
    assert (got.tier, got.step) == ("fast", 10)
    assert [(p.step, "shard-00001.safetensors" in p.reason) for p in got.passed] == [(30, True)]


def test_a_durable_file_of_another_size_is_never_chosen(fast: Path, tier, tmp_path: Path) -> None:
    (durable_copy(tier, tmp_path, 30) / "shard-00000.safetensors").write_bytes(b"short")
    got = across(fast, tier)
    assert (got.tier, got.step, [p.step for p in got.passed]) == (None, None, [30])


def test_a_flipped_byte_in_a_durable_file_is_passed_over_by_a_deep_choice(fast: Path, tier, tmp_path: Path) -> None:
    durable_copy(tier, tmp_path, 20)
    flip_byte(durable_copy(tier, tmp_path, 30) / "shard-00000.safetensors", 3)
    got = tiers.across(choice.choose(fast), tier, deep=True)
    assert (got.tier, got.step, [p.step for p in got.passed]) == ("durable", 20, [30])


def test_the_bound_on_the_step_holds_in_the_durable_tier_too(fast: Path, tier, tmp_path: Path) -> None:
    make_fake_checkpoint(fast, 10, default_files(10))
    for step in (20, 30):
        durable_copy(tier, tmp_path, step)
    got = across(fast, tier, at_most=25)
    assert (got.tier, got.step) == ("durable", 20)


def test_a_durable_checkpoint_created_before_the_fast_tiers_choice_is_from_a_timeline_left_behind(
    fast: Path, tier, tmp_path: Path
) -> None:
    tier.upload(make_fake_checkpoint(tmp_path / "before-the-rollback", 30, default_files(30), created_unix=1000.0))
    make_fake_checkpoint(fast, 20, default_files(20), created_unix=2000.0)  # saved again after a rollback to 10
    got = across(fast, tier)
    assert (got.tier, got.step) == ("fast", 20)
    assert [(p.step, "a timeline this run has left" in p.reason) for p in got.passed] == [(30, True)]


def test_a_durable_step_already_given_up_on_is_not_chosen_again(fast: Path, tier, tmp_path: Path) -> None:
    for step in (20, 30):
        durable_copy(tier, tmp_path, step)
    got = tiers.across(choice.choose(fast), tier, exclude={tier.step_url(30)})
    assert (got.tier, got.step) == ("durable", 20)


def test_no_checkpoint_in_either_tier_is_a_fresh_start(fast: Path, tier) -> None:
    got = across(fast, tier)
    assert (got.tier, got.info, got.passed) == (None, None, ())


def test_without_a_durable_tier_the_choice_is_the_fast_tiers(fast: Path) -> None:
    make_fake_checkpoint(fast, 10, default_files(10))
    got = across(fast, None)
    assert (got.tier, got.step, got.durable) == ("fast", 10, None)


def test_a_durable_step_is_found_checked_and_its_small_files_read_verified(tier, tmp_path: Path) -> None:
    rel = "rank-00000/state.json"
    where = durable_copy(tier, tmp_path, 20)
    pick = tiers.find_durable(tier, 20)
    assert tiers.read_verified(tier, pick, rel, 1 << 20) == (where / rel).read_bytes()
    flip_byte(where / rel, 0)
    with pytest.raises(CheckpointCorruptError, match=f"durable/step-000000020/{rel}: checksum mismatch"):
        tiers.read_verified(tier, pick, rel, 1 << 20)
    with pytest.raises(NoCheckpointError):
        tiers.find_durable(tier, 21)
