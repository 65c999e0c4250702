"""Bad input on resume: refused with a clear error before any step, nothing loaded."""

from __future__ import annotations

import sys

import pytest
import structlog
import torch

from ftsup.store import layout
from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointMismatchError
from ftsup.trainer.data import DataPositionError, GlobalBatchSchedule
from ftsup.trainer.examples.gpt import GPT, WarmupCosine
from ftsup.trainer.state import TrainingState
from tests.procs import run

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--corpus-bytes", "50000"]


def gpt(*args: str):
    return run([sys.executable, "-m", "ftsup.trainer.examples.gpt", *SMALL, *args], timeout=120)


def test_global_batch_the_world_size_cannot_split_is_refused_before_any_step(tmp_path):
    files = ("--ckpt-dir", str(tmp_path / "c"), "--loss-log", str(tmp_path / "l"))
    r = gpt("--steps", "2", *files, "--global-batch", "12", "--micro-batch", "5")
    assert r.returncode == 2
    assert "global batch 12 cannot be split into micro-batches of 5 over 1 ranks" in r.output
    assert not (tmp_path / "l").exists()


def test_checkpoint_of_another_model_configuration_is_refused_naming_the_difference(tmp_path):
    ok = gpt("--steps", "2", "--ckpt-every", "1", "--ckpt-dir", str(tmp_path / "c"))
    assert ok.returncode == 0, ok.output[-3000:]
    r = gpt("--steps", "4", "--ckpt-dir", str(tmp_path / "c"), "--loss-log", str(tmp_path / "l"), "--dropout", "0.2")
    assert r.returncode == 2
    assert "config.dropout: checkpoint 0.1 != this run 0.2" in r.output
    assert not (tmp_path / "l").exists()


def make(seed: int = 0, samples_bug: int = 0) -> TrainingState:
    torch.manual_seed(seed)
    model = GPT(256, 16, 1, 2, 32, 0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(2, 10))
    schedule = GlobalBatchSchedule(dataset_size=100, global_batch=4, micro_batch=2, world_size=1, rank=0, seed=0)
    return TrainingState(model, opt, sched, schedule=schedule, config={"n_embd": 32})


def step_once(state: TrainingState) -> float:
    torch.manual_seed(1000 + state.step)
    x = torch.randint(0, 256, (2, 17))
    loss = state.model(x[:, :-1], x[:, 1:])
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad()
    state.step += 1
    assert state.schedule is not None
    state.samples = state.schedule.position_after(state.step)
    return loss.item()


def test_single_process_state_resumes_bitwise(tmp_path):
    with CheckpointEngine(tmp_path) as eng:
        a = make()
        for _ in range(3):
            step_once(a)
        a.save(eng, block=True)
        want = [step_once(a) for _ in range(3)]
        b = make(seed=5)
        assert b.resume(eng).step == 3
        assert (b.step, b.samples, b.scheduler.last_epoch) == (3, 12, 3)
        assert [step_once(b) for _ in range(3)] == want


def test_corrupt_data_position_is_an_error_not_a_restart_from_zero(tmp_path):
    with CheckpointEngine(tmp_path) as eng:
        a = make()
        step_once(a)
        a.samples = 7  # a data position that does not belong to step 1
        a.save(eng, block=True)
        b = make()
        with pytest.raises(DataPositionError, match="does not match step 1"):
            b.resume(eng)
        assert (b.step, b.samples) == (0, 0)


def test_corrupt_progress_entry_in_the_state_is_refused():
    a = make()
    sd = a.state_dict()
    sd["progress"] = {"step": "three"}
    with pytest.raises(DataPositionError, match="malformed"):
        a.load_state_dict(sd)


def test_a_missing_scheduler_on_resume_is_a_mismatch(tmp_path):
    with CheckpointEngine(tmp_path) as eng:
        a = make()
        step_once(a)
        a.save(eng, block=True)
        b = make(seed=3)
        b.scheduler = None
        before = [p.detach().clone() for p in b.model.parameters()]
        with pytest.raises(
            CheckpointMismatchError, match="checkpoint has scheduler state but this run has no scheduler"
        ):
            b.resume(eng)
        assert all(torch.equal(x, y) for x, y in zip(before, b.model.parameters(), strict=True))  # nothing loaded


def test_a_fresh_start_after_unusable_checkpoints_is_logged_as_a_warning(tmp_path):
    with CheckpointEngine(tmp_path) as eng:
        a = make()
        step_once(a)
        a.save(eng, block=True)
    (tmp_path / layout.step_dirname(1) / layout.MANIFEST_NAME).write_bytes(b"[" * 5000)
    b = make()
    with structlog.testing.capture_logs() as logs, CheckpointEngine(tmp_path) as eng:
        assert b.resume(eng) is None
    (warning,) = [e for e in logs if e["event"] == "training_started_from_scratch"]
    assert (warning["log_level"], warning["unusable"], b.step) == ("warning", 1, 0)
    assert "step-000000001 skipped" in warning["reason"]


def test_a_fresh_start_without_any_checkpoint_is_not_a_warning(tmp_path):
    with structlog.testing.capture_logs() as logs, CheckpointEngine(tmp_path) as eng:
        assert make().resume(eng) is None
    assert [e for e in logs if e["log_level"] == "warning"] == []
