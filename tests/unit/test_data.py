"""The global batch schedule: world-size independent, every sample once per epoch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ftsup.trainer.data import DataConfigError, DataPositionError, GlobalBatchSchedule, RankBatchSampler


def schedules(world: int, **kw) -> list[GlobalBatchSchedule]:
    args = dict(dataset_size=50, global_batch=12, micro_batch=2, seed=7) | kw
    return [GlobalBatchSchedule(world_size=world, rank=r, **args) for r in range(world)]


def global_batch(world: int, step: int) -> list[int]:
    """The step's samples, in micro-batch order, reassembled from every rank."""
    micro = [mb for s in schedules(world) for mb in s.rank_micro_batches(step)]
    return [i for mb in sorted(micro, key=lambda m: m.index) for i in mb.sample_ids]


@pytest.mark.parametrize("world", [1, 2, 3, 6])
def test_global_batches_are_the_same_on_every_world_size(world):
    assert [global_batch(world, s) for s in range(1, 10)] == [global_batch(1, s) for s in range(1, 10)]


def test_each_epoch_is_a_permutation_of_the_dataset():
    (s,) = schedules(1, dataset_size=48)
    ids = [i for step in range(1, 5) for mb in s.rank_micro_batches(step) for i in mb.sample_ids]
    assert Counter(ids) == Counter(range(48))


def test_epochs_are_reshuffled():
    (s,) = schedules(1, dataset_size=12)
    assert s.sample_ids(0, 12) != s.sample_ids(12, 12)


def test_micro_batches_are_dealt_round_robin_and_accumulate_to_the_global_batch():
    s0, s1, s2 = schedules(3)
    assert [mb.index for mb in s1.rank_micro_batches(1)] == [1, 4]
    assert s0.accumulation_steps == 2 and s0.micro_batches_per_step == 6


def test_a_world_size_that_cannot_split_the_global_batch_is_a_clear_error():
    with pytest.raises(DataConfigError, match=r"global batch 12 .* not a multiple of 2 x 4 = 8"):
        GlobalBatchSchedule(dataset_size=50, global_batch=12, micro_batch=2, world_size=4, rank=0, seed=0)


@pytest.mark.parametrize("samples", [-12, "36", None, 35, 0, True])
def test_a_data_position_that_does_not_belong_to_the_step_is_refused(samples):
    (s,) = schedules(1)
    with pytest.raises(DataPositionError):
        s.check_position(3, samples)


def test_sampler_resumes_after_the_saved_step_for_any_dataloader():
    (s,) = schedules(2)[1:]
    loader = torch.utils.data.DataLoader(list(range(50)), batch_sampler=RankBatchSampler(s, 3, 5), num_workers=2)
    got = [b.tolist() for b in loader]
    want = [list(mb.sample_ids) for step in (4, 5) for mb in s.rank_micro_batches(step)]
    assert got == want and len(RankBatchSampler(s, 3, 5)) == 6


# ---------------------------------------------------------------------- data skips

SKIPS = ((3, 5), (14, 20), (30, 31))


def served_positions(world: int, steps: int, **kw) -> list[int]:
    """Every position served by steps 1..steps, in the global batches' order, from every rank."""
    micro = [mb for s in schedules(world, **kw) for step in range(1, steps + 1) for mb in s.rank_micro_batches(step)]
    return [p for mb in sorted(micro, key=lambda m: (m.step, m.index)) for p in mb.positions]


def test_a_schedule_serves_the_positions_outside_its_skips_in_order():
    outside = [p for p in range(200) if not any(a <= p < b for a, b in SKIPS)]
    assert served_positions(1, 5, skips=SKIPS) == outside[:60]


def test_without_skips_the_positions_served_are_the_global_order():
    assert served_positions(1, 4) == list(range(48))


@pytest.mark.parametrize("world", [2, 3, 6])
def test_with_skips_every_world_size_serves_the_global_batches_of_one_rank(world):
    def batches(w: int) -> list[list[int]]:
        micro = sorted((mb for s in schedules(w, skips=SKIPS) for mb in s.rank_micro_batches(4)), key=lambda m: m.index)
        return [list(mb.sample_ids) for mb in micro]

    assert batches(world) == batches(1)


def test_a_micro_batch_holds_the_samples_of_its_positions():
    (s,) = schedules(1, skips=SKIPS)
    mb = s.rank_micro_batches(1)[1]  # positions 2 and 5: the skip [3, 5) lies between
    assert (mb.positions, mb.first_position, mb.sample_ids) == ((2, 5), 2, s.sample_ids(2, 1) + s.sample_ids(5, 1))


def test_the_position_after_a_step_is_one_past_the_last_position_it_served():
    (s,) = schedules(1, skips=SKIPS)
    assert [s.position_after(k) for k in range(4)] == [0, 14, 33, 45]


def test_a_skip_that_begins_after_a_step_does_not_move_that_steps_position():
    (s,) = schedules(1)
    assert s.with_skips([(24, 40)]).position_after(2) == s.position_after(2) == 24


def test_skips_are_sorted_and_merged():
    (s,) = schedules(1, skips=[(14, 20), (3, 5), (4, 8), (8, 9)])
    assert s.skips == ((3, 9), (14, 20))


def test_with_skips_adds_to_the_skips_a_schedule_has():
    (s,) = schedules(1, skips=[(3, 5)])
    assert s.with_skips([(10, 12)]).skips == ((3, 5), (10, 12))


@pytest.mark.parametrize("skip", [(5, 5), (6, 2), (-1, 3), (1.0, 3), (True, 3), (0, 2**53 + 1), (1, 2, 3), "ab"])
def test_a_skip_that_is_not_a_range_of_positions_is_refused(skip):
    with pytest.raises(DataConfigError, match="data skip"):
        schedules(1, skips=[skip])


def test_more_skips_than_the_limit_are_refused():
    with pytest.raises(DataConfigError, match="more than 64"):
        schedules(1, skips=[(2 * i, 2 * i + 1) for i in range(65)])


def test_a_data_position_is_checked_with_the_skips():
    (s,) = schedules(1, skips=SKIPS)
    s.check_position(2, 33)
    with pytest.raises(DataPositionError, match=r"does not match step 2 .* skips \[\[3, 5\]"):
        s.check_position(2, 24)


def test_the_sampler_serves_a_schedule_with_skips():
    (s,) = schedules(2, skips=SKIPS)[1:]
    got = [b for b in RankBatchSampler(s, 1, 3)]
    want = [list(mb.sample_ids) for step in (2, 3) for mb in s.rank_micro_batches(step)]
    assert got == want
