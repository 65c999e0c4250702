"""A commit's preparation fails as an answer every rank gets, never raised on the leader alone (which would leave the
other ranks in the next collective until the group's timeout): a failure other than an OSError in a memory tier's
commit is a save that failed on every rank, logged by the memory tier, never raised."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from ftsup.store.retention import RetentionPolicy
from ftsup.trainer.checkpoint import memory as memtiers
from ftsup.trainer.checkpoint.comm import LocalComm
from ftsup.trainer.checkpoint.commit import CheckpointSaveError, Committer, StagedSave


class BrokenReader(Committer):
    """A store whose reading of a step already there fails with something else than an OSError (a bug, say)."""

    def _existing(self, step: int, final: Path) -> dict[str, Any] | None:
        raise ValueError("the reader broke")


class Job:
    """The little of a staged save that a commit reads before its preparation's answer."""

    def __init__(self, step: int) -> None:
        self.step, self.kind, self.released = step, "emergency", 0

    def release(self) -> None:
        self.released += 1


def committer(tmp_path: Path, node: str | None) -> BrokenReader:
    (tmp_path / "memory").mkdir()
    kept = RetentionPolicy()
    comm = LocalComm()
    return BrokenReader(
        tmp_path / "memory", comm, o_direct=False, retention=kept, recycle=False, hook=lambda *_: None, node=node
    )


@pytest.mark.parametrize("node", [None, "node-a"])
def test_a_leaders_failure_other_than_an_oserror_in_preparing_is_the_answer_every_rank_gets(
    tmp_path: Path, node: str | None
) -> None:
    c = committer(tmp_path, node)
    c.leader = True
    job = Job(4)
    with pytest.raises(CheckpointSaveError, match=r"ValueError: the reader broke"):
        c.write(cast(StagedSave, job))
    assert (job.released, sorted(p.name for p in (tmp_path / "memory").iterdir())) == (1, [])


def test_the_memory_tier_logs_such_a_failure_and_raises_nothing(tmp_path: Path) -> None:
    c = committer(tmp_path, "node-a")
    c.leader = True
    assert memtiers.write(c, cast(StagedSave, Job(4))) is False
