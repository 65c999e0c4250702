"""The reference trainer's `--fault` forms (`ftsup.trainer.examples.faults`): what each parses to,
which attempts it is in, and the data positions a data fault poisons."""

from __future__ import annotations

import math

import pytest
import torch

from ftsup.trainer.examples.faults import SPIKE_LOSS_SCALE, Fault, Poison, parse


@pytest.mark.parametrize(
    ("spec", "fault"),
    [("kill@7", Fault("kill", 7, 1)), ("nan@4", Fault("nan", 4, 1)), ("nan@4:0", Fault("nan", 4, 0)),
     ("spike@5:3", Fault("spike", 5, -1, 3)), ("slow@1:2.5", Fault("slow", 1, 1, factor=2.5))],
)  # fmt: skip
def test_each_form_of_fault_parses_to_what_it_names(spec, fault):
    assert parse(spec, 1, attempt=1, fault_attempt=1) == fault


@pytest.mark.parametrize("spec", ["nan", "nan@", "nan@x", "spike@5", "spike@5:0", "slow@1", "slow@1:0.5",
                                  "slow@1:nan", "kill@3:1", "boom@3"])  # fmt: skip
def test_a_fault_of_no_form_is_refused_naming_the_forms(spec):
    with pytest.raises(SystemExit, match="nan@STEP"):
        parse(spec, 0, attempt=1, fault_attempt=1)


def test_a_process_fault_is_in_its_attempt_only_and_a_data_fault_in_every_one():
    got = [parse(spec, 0, attempt=2, fault_attempt=1).kind for spec in ("kill@3", "slow@0:2", "nan@3", "spike@3:1")]
    assert got == ["", "", "nan", "spike"]


def test_a_nan_fault_poisons_the_positions_of_its_step_on_its_rank_only():
    fault = parse("nan@2:1", 0, attempt=1, fault_attempt=1)
    loss = torch.tensor(1.5)
    hits = [(rank, math.isnan(float(Poison(fault, 12, 0, rank).loss(positions, loss))))
            for rank in (0, 1) for positions in ((11, 12), (23, 24))]  # fmt: skip
    assert hits == [(0, False), (0, False), (1, True), (1, True)]


def test_a_spike_fault_replaces_the_rows_at_its_positions_and_scales_their_loss():
    poison = Poison(parse("spike@2:1", 0, attempt=1, fault_attempt=1), 12, 0, rank=0)
    tokens = torch.zeros(2, 5, dtype=torch.long)
    got = poison.tokens((11, 12), tokens)
    changed = [bool((got[i] != 0).any()) for i in (0, 1)]
    assert (changed, float(poison.loss((11, 12), torch.tensor(2.0)))) == ([False, True], 2.0 * SPIKE_LOSS_SCALE)
