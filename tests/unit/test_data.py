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
