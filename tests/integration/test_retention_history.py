"""The engine's retention keeps what a rollback needs: a pinned checkpoint and a history window
(`FTSUP_KEEP_OLDER_THAN_STEPS`, as the supervisor sets it), with a real engine saving real steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftsup.protocol import KEEP_OLDER_THAN_STEPS_ENV
from ftsup.store import layout, pins
from ftsup.supervisor.cli.commands import main
from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointError, RetentionPolicy
from ftsup.trainer.checkpoint.stateful import ModelOptimState


def make_state() -> tuple[ModelOptimState, torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return ModelOptimState(model, torch.optim.SGD(model.parameters(), lr=0.1)), model


def train(root: Path, steps: int, *, pin_at: int | None = None, retention: RetentionPolicy | None = None) -> None:
    state, model = make_state()
    with CheckpointEngine(root, retention=retention) as eng:
        for step in range(1, steps + 1):
            with torch.no_grad():
                model.weight.add_(1.0)
            eng.save(step, {"app": state}, block=True)
            if step == pin_at:
                assert main(["ckpt", "pin", str(root), "--step", str(step), "--reason", "test"]) == 0


def test_twenty_steps_with_keep_last_2_keep_the_pin_and_the_history_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(KEEP_OLDER_THAN_STEPS_ENV, "5")
    train(tmp_path, 20, pin_at=3, retention=RetentionPolicy(keep_last=2))
    assert [i.step for i in layout.list_checkpoints(tmp_path) if i.consistent] == [3, 15, 16, 17, 18, 19, 20]


def test_without_pin_or_history_keep_last_2_keeps_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_OLDER_THAN_STEPS_ENV, raising=False)
    train(tmp_path, 20, retention=RetentionPolicy(keep_last=2))
    assert [i.step for i in layout.list_checkpoints(tmp_path)] == [19, 20]


def test_the_default_retention_keeps_the_history_the_environment_asks_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEEP_OLDER_THAN_STEPS_ENV, "8")
    train(tmp_path, 20)  # RetentionPolicy(): keep_last=3
    assert [i.step for i in layout.list_checkpoints(tmp_path)] == [12, 13, 14, 15, 16, 17, 18, 19, 20]


def test_an_unpinned_checkpoint_goes_with_the_next_commit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state, _ = make_state()
    with CheckpointEngine(tmp_path, retention=RetentionPolicy(keep_last=1)) as eng:
        eng.save(1, {"app": state}, block=True)
        pins.pin(tmp_path, 1, who="op", reason="", now=1.0)
        eng.save(2, {"app": state}, block=True)
        eng.wait()
        pins.unpin(tmp_path, 1, who="op", reason="", now=2.0)
        eng.save(3, {"app": state}, block=True)
    assert [i.step for i in layout.list_checkpoints(tmp_path)] == [3]


def test_a_bad_history_in_the_environment_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEEP_OLDER_THAN_STEPS_ENV, "lots")
    with pytest.raises(CheckpointError, match=f"environment variable {KEEP_OLDER_THAN_STEPS_ENV}='lots'"):
        CheckpointEngine(tmp_path)
