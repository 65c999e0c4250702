"""The reference trainer's `--fault` forms (`ftsup.trainer.examples.faults`): what each parses to,
which attempts it is in, and the data positions a data fault poisons."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from ftsup.trainer.examples.faults import SPIKE_LOSS_SCALE, Fault, Poison, Trigger, parse


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("kill@7", Fault("kill", 7, 1)),
        ("nan@4", Fault("nan", 4, 1)),
        ("nan@4:0", Fault("nan", 4, 0)),
        ("spike@5:3", Fault("spike", 5, -1, 3)),
        ("slow@1:2.5", Fault("slow", 1, 1, factor=2.5)),
    ],
)
def test_each_form_of_fault_parses_to_what_it_names(spec, fault):
    assert parse(spec, 1, attempt=1, fault_attempt=1) == fault


@pytest.mark.parametrize(
    "spec", ["nan", "nan@", "nan@x", "spike@5", "spike@5:0", "slow@1", "slow@1:0.5", "slow@1:nan", "kill@3:1", "boom@3"]
)
def test_a_fault_of_no_form_is_refused_naming_the_forms(spec):
    with pytest.raises(SystemExit, match="nan@STEP"):
        parse(spec, 0, attempt=1, fault_attempt=1)


def test_a_process_fault_is_in_its_attempt_only_and_a_data_fault_in_every_one():
    got = [parse(spec, 0, attempt=2, fault_attempt=1).kind for spec in ("kill@3", "slow@0:2", "nan@3", "spike@3:1")]
    assert got == ["", "", "nan", "spike"]


def test_a_nan_fault_poisons_the_positions_of_its_step_on_its_rank_only():
    fault = parse("nan@2:1", 0, attempt=1, fault_attempt=1)
    loss = torch.tensor(1.5)
    hits = [
        (rank, math.isnan(float(Poison(fault, 12, 0, rank).loss(positions, loss))))
        for rank in (0, 1)
        for positions in ((11, 12), (23, 24))
    ]
    assert hits == [(0, False), (0, False), (1, True), (1, True)]


def test_a_spike_fault_replaces_the_rows_at_its_positions_and_scales_their_loss():
    poison = Poison(parse("spike@2:1", 0, attempt=1, fault_attempt=1), 12, 0, rank=0)
    tokens = torch.zeros(2, 5, dtype=torch.long)
    got = poison.tokens((11, 12), tokens)
    changed = [bool((got[i] != 0).any()) for i in (0, 1)]
    assert (changed, float(poison.loss((11, 12), torch.tensor(2.0)))) == ([False, True], 2.0 * SPIKE_LOSS_SCALE)


def _ask(path, **doc):  # type: ignore[no-untyped-def]
    """Replace the fault file atomically, as the asker does."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def test_a_fault_file_asking_this_pid_to_exit_is_served_once(tmp_path):
    trigger = Trigger(str(tmp_path / "fault.json"))
    _ask(tmp_path / "fault.json", pid=os.getpid(), kind="exit")
    assert [trigger.poll(), trigger.poll()] == ["exit", ""]


def test_a_fault_file_asking_another_pid_is_ignored(tmp_path):
    trigger = Trigger(str(tmp_path / "fault.json"))
    _ask(tmp_path / "fault.json", pid=os.getpid() + 1, kind="exit")
    assert trigger.poll() == ""


def test_a_kill_in_commit_is_armed_for_its_point_only(tmp_path):
    trigger = Trigger(str(tmp_path / "fault.json"))
    _ask(tmp_path / "fault.json", pid=os.getpid(), kind="kill-in-commit", point="manifest_written")
    armed = [trigger.poll(), trigger.kills_at("shard_written"), trigger.kills_at("manifest_written")]
    assert armed == ["", False, True]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[1]",
        b'{"pid": "me", "kind": "exit"}',
        b" " * 5000,
        b'{"kind": "kill-in-commit", "point": "anywhere"}',
    ],
)
def test_a_fault_file_of_no_schema_is_ignored(tmp_path, content):
    path = tmp_path / "fault.json"
    if content.startswith(b'{"kind"'):  # this pid, asking for a point that does not exist
        content = json.dumps({**json.loads(content), "pid": os.getpid()}).encode()
    path.write_bytes(content)
    assert Trigger(str(path)).poll() == ""


def test_a_fault_file_that_is_a_symlink_is_ignored(tmp_path):
    _ask(tmp_path / "real.json", pid=os.getpid(), kind="exit")
    (tmp_path / "fault.json").symlink_to(tmp_path / "real.json")
    assert Trigger(str(tmp_path / "fault.json")).poll() == ""
