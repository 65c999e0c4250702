"""The plan of `ftsup chaos` (`ftsup.tools.faults.plan`): seeded, every kind, forms that exist."""

from __future__ import annotations

import pytest

from ftsup.tools.faults.plan import COMMIT_POINTS, KINDS, RANK0_POINTS, make_plan, steps_needed


def test_the_same_seed_draws_the_same_plan():
    assert make_plan(30, seed=4) == make_plan(30, seed=4)


def test_another_seed_draws_another_plan():
    assert make_plan(30, seed=4) != make_plan(30, seed=5)


def test_a_plan_of_at_least_as_many_faults_as_kinds_holds_every_kind():
    assert {f.kind for f in make_plan(len(KINDS), seed=0)} == set(KINDS)


def test_a_plan_of_fewer_faults_than_kinds_holds_no_kind_twice():
    kinds = [f.kind for f in make_plan(5, seed=0)]
    assert len(set(kinds)) == 5


def test_a_plan_counts_its_faults_in_order():
    assert [f.index for f in make_plan(20, seed=2)] == list(range(1, 21))


def test_a_kill_at_a_commit_point_of_rank_0_targets_rank_0():
    commits = [f for f in make_plan(200, seed=3) if f.kind == "kill-in-commit"]
    assert {f.rank for f in commits if f.variant in RANK0_POINTS} == {0}


def test_each_variant_is_a_form_the_job_takes():
    forms = {
        "evict-signal": {"SIGTERM", "SIGUSR1"},
        "evict-metadata": {"aws", "gcp", "azure"},
        "kill-in-commit": set(COMMIT_POINTS),
    }
    drawn: dict[str, set[str]] = {}
    for f in make_plan(300, seed=1):
        drawn.setdefault(f.kind, set()).add(f.variant)
    assert {k: drawn[k] for k in forms} == forms


def test_the_commit_points_are_the_reference_trainers():
    from ftsup.trainer.examples.faults import COMMIT_POINTS as TRAINERS

    assert COMMIT_POINTS == TRAINERS


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(ValueError, match="kill-rank"):
        make_plan(3, seed=0, kinds=("kill-rank", "meteor"))


def test_a_longer_plan_needs_more_steps():
    assert steps_needed(make_plan(10, seed=0), 5) < steps_needed(make_plan(40, seed=0), 5)
