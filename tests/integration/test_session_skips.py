"""`ftsup.Session` and `TrainingState` with data skips, in one process: a session told to skip
serves the batches of a schedule built with those skips, records them in every checkpoint and
keeps them on resume; a checkpoint's skips are read as hostile input. And the step guard decides
alike on every rank (`tests/bin/guard_ranks.py` under torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ftsup import GlobalBatchSchedule, Session
from ftsup.store import layout
from ftsup.trainer.data import DataPositionError
from tests.procs import torchrun

SKIP = [(6, 11), (20, 22)]
DATA = [torch.tensor([float(i)]) for i in range(64)]


def session(tmp: Path, **kw) -> Session:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    return Session(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        None,
        DATA,
        global_batch=4,
        micro_batch=2,
        ckpt_dir=tmp / "ckpt",
        save_every=2,
        **kw,
    )


def train(s: Session, total: int) -> dict[int, list[int]]:
    """Run the session to `total`; the sample ids each step served."""
    served = {}
    for step in s.steps(total):
        ids = []
        for batch in s.micro_batches():
            s.model(batch).pow(2).mean().backward()
            ids += [int(x) for x in batch.reshape(-1)]
        s.clip_and_step(None, 0.0)
        served[step] = ids
    return served


def expected(steps: range, skips=SKIP) -> dict[int, list[int]]:
    schedule = GlobalBatchSchedule(len(DATA), 4, 2, 1, 0, 0, skips=skips)
    return {k: [i for mb in schedule.rank_micro_batches(k) for i in mb.sample_ids] for k in steps}


def test_a_session_told_to_skip_serves_the_batches_of_a_schedule_built_with_the_skips(tmp_path):
    assert train(session(tmp_path, skip=SKIP), 6) == expected(range(1, 7))


def test_every_checkpoint_records_the_skips_in_force(tmp_path):
    train(session(tmp_path, skip=SKIP), 6)
    recorded = [layout.read_manifest(c).metadata["data_skips"] for c in sorted((tmp_path / "ckpt").glob("step-*"))]
    assert recorded == [[list(r) for r in SKIP]] * 3


def test_a_resumed_session_keeps_the_skips_of_its_checkpoint(tmp_path):
    train(session(tmp_path, skip=SKIP), 2)
    resumed = session(tmp_path)
    assert (resumed.step, resumed.schedule.skips, train(resumed, 6)) == (2, tuple(SKIP), expected(range(3, 7)))


def test_a_resumed_session_adds_new_skips_to_its_checkpoints(tmp_path):
    train(session(tmp_path, skip=SKIP[:1]), 2)
    resumed = session(tmp_path, skip=[(30, 40)])
    assert (resumed.schedule.skips, train(resumed, 6)) == (
        ((6, 11), (30, 40)),
        expected(range(3, 7), [(6, 11), (30, 40)]),
    )


@pytest.mark.parametrize("skips", [[[5, 1]], [[1, 2.5]], "1:2", [[1, 3], [2, 4]], [[0, 1]] * 65])
def test_a_checkpoint_whose_skips_are_malformed_is_refused_naming_them(tmp_path, skips):
    s = session(tmp_path)
    meta = {**s.state.metadata(), "data_skips": skips}
    try:
        with pytest.raises(DataPositionError, match="the checkpoint's data_skips"):
            s.state.check_metadata(meta)
    finally:
        s.close()


@pytest.mark.multiprocess
def test_a_nan_loss_on_one_rank_is_refused_on_every_rank(tmp_path):
    r = torchrun("guard_ranks.py", ["--nan-rank", "1", "--out", str(tmp_path / "out.{rank}.json")], nproc=2)
    assert r.returncode == 0, r.output[-3000:]
    got = [json.loads((tmp_path / f"out.{rank}.json").read_text())["refused"] for rank in (0, 1)]
    assert got == [True, True]
