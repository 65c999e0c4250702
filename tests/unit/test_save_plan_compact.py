"""The first save's compact plan (`saveplan`): the same plan and metadata as DCP's planner for the same state,
DCP's errors for an invalid one, and DCP's planner itself for a state the compact form cannot say."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ftsup.tools.bench.scale import ops as scale_ops
from ftsup.tools.bench.scale.state import Job, Model, SimShard
from ftsup.trainer.checkpoint import saveplan, staging
from ftsup.trainer.checkpoint.comm import LocalComm


def _both(states: list[dict[str, Any]]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(DCP's planner's, the compact plan's) every rank's layout and the coordinator's metadata for `states`."""
    planners_locals = [staging.plan_local(s, rank == 0) for rank, s in enumerate(states)]
    per_rank, head = staging.plan_global(planners_locals[0][0], [local for _, local in planners_locals])
    dcp = [staging.plan_finish(p, (), mine, None) for (p, _), mine in zip(planners_locals, per_rank, strict=True)]
    items = [saveplan.local_items(s) for s in states]
    assert all(i is not None for i in items)
    chunks, compact_head = staging.compact_global(items)  # type: ignore[arg-type]
    ours = [staging.compact_finish((), c, None) for c in chunks]

    def seen(plans: list[staging.StagingPlan], h: bytes) -> tuple[Any, ...]:
        return (h, [(p.layout.header, p.layout.total_size, p.sources, p.tensor_bytes) for p in plans])

    return seen(dcp, head), seen(ours, compact_head)


@pytest.mark.parametrize(("world", "pp"), [(1, 1), (4, 2), (6, 3), (16, 4)])
def test_the_compact_plan_of_sharded_tensors_is_dcp_s(world: int, pp: int) -> None:
    job = Job(Model(layers=3, hidden=24, ffn=40, vocab=56), world, pp)
    dcp, ours = _both([job.rank_state(r) for r in range(world)])
    assert ours == dcp


def test_replicated_tensors_are_saved_once_by_the_rank_dcp_picks() -> None:
    torch.manual_seed(0)
    shared = {
        "a": torch.randn(64, 8),
        "b": torch.randn(3, dtype=torch.bfloat16),
        "c": torch.randn(128),
        "d": torch.randn(5, 5),
        "e": torch.tensor(3.0),
    }
    states = [dict(shared, **{f"own{r}": torch.randn(r + 1, 2)}) for r in range(3)]
    dcp, ours = _both(states)
    assert ours == dcp
    written = [fqn for _, _, sources, _ in ours[1] for fqn, _ in sources]
    assert sorted(written) == sorted([*shared, "own0", "own1", "own2"])  # each shared tensor by one rank
    assert len({tuple(sources) for _, _, sources, _ in ours[1]}) == 3


def assert_refused_as_dcp_refuses(states: list[dict[str, Any]]) -> None:
    """The compact plan's check refuses `states` with DCP's own error, word for word."""
    planners_locals = [staging.plan_local(s, r == 0) for r, s in enumerate(states)]
    with pytest.raises(ValueError, match="Failed to validate global plan") as dcp_error:
        staging.plan_global(planners_locals[0][0], [local for _, local in planners_locals])
    with pytest.raises(ValueError, match="Failed to validate global plan") as ours:
        staging.compact_global([saveplan.local_items(s) for s in states])  # type: ignore[misc]
    assert str(ours.value) == str(dcp_error.value)


def test_an_overlapping_plan_fails_with_dcp_s_own_error() -> None:
    job = Job(Model(layers=1, hidden=8, ffn=8, vocab=8), 2, 1)
    states = [job.rank_state(0), job.rank_state(0)]
    # Two ranks writing the same shard is a replicated shard to both (deduplicated): make one rank's differ.
    first = next(iter(states[1]))
    shard = states[1][first]
    states[1][first] = type(shard)(shard.shape, shard.dtype, (1, *shard.offsets[1:]), shard.sizes)
    assert_refused_as_dcp_refuses(states)


class _Tagged(torch.Tensor):
    """A tensor subclass: what the compact form does not say (DCP's planner plans it)."""


def test_a_state_the_compact_form_cannot_say_is_planned_by_dcp_s_planner() -> None:
    flat: dict[str, Any] = {"w": torch.ones(4, 3), "t": torch.zeros(6).as_subclass(_Tagged)}
    assert saveplan.local_items(flat) is None
    plan = staging.make_plan(flat, staging.signature(flat), LocalComm())
    planner, local = staging.plan_local(flat, True)
    per_rank, head = staging.plan_global(planner, [local])
    want = staging.plan_finish(planner, plan.signature, per_rank[0], head)
    assert (plan.layout.header, plan.sources, plan.meta_head) == (want.layout.header, want.sources, want.meta_head)
    assert {fqn for fqn, _ in plan.sources} == {"w", "t"}


def test_a_plain_state_is_planned_in_compact_form_as_dcp_would() -> None:
    flat: dict[str, Any] = {"w": torch.ones(4, 3), "b": torch.zeros(6, dtype=torch.bfloat16), "n": torch.tensor(4)}
    assert saveplan.local_items(flat) is not None
    plan = staging.make_plan(flat, staging.signature(flat), LocalComm())
    planner, local = staging.plan_local(flat, True)
    per_rank, head = staging.plan_global(planner, [local])
    want = staging.plan_finish(planner, plan.signature, per_rank[0], head)
    assert (plan.layout.header, plan.sources, plan.meta_head) == (want.layout.header, want.sources, want.meta_head)


def test_the_bench_s_first_save_plans_the_engine_s_compact_plan() -> None:
    job = Job(Model(layers=2, hidden=16, ffn=24, vocab=32), 8, 2)
    planned = scale_ops.save_plan_first(job)
    dcp, ours = _both([job.rank_state(r) for r in range(8)])
    assert planned.plan0.meta_head == ours[0] == dcp[0]


@pytest.mark.parametrize(("second", "valid"), [((0, 4), True), ((0, 3), False), ((1, 4), False)])
def test_a_tensor_cut_along_a_shorter_dim_is_checked_as_dcp_checks_it(second: tuple[int, int], valid: bool) -> None:
    shape = (16, 8)  # cut along dim 1, the shorter: the check sweeps the dim the chunks are cut along
    sizes = (16 - second[0], 8 - second[1])
    states = [
        {"w": SimShard(shape, torch.float32, (0, 0), (16, 4))},
        {"w": SimShard(shape, torch.float32, second, sizes)},
    ]
    if valid:
        dcp, ours = _both(states)
        assert ours == dcp
        return
    assert_refused_as_dcp_refuses(states)
