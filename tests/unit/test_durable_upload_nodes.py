"""The durable tier's uploader in a job whose nodes keep separate fast tiers: a checkpoint whose commit waits for
the other nodes' parts waits again in the queue, and other checkpoints go meanwhile (supervisor/durable_upload.py)."""

from __future__ import annotations

from pathlib import Path

from ftsup.store import durable, layout
from ftsup.store.errors import DurableWaitError
from ftsup.supervisor.durable_upload import Outcome, Uploader
from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import wait_for


class _WaitsForStep1(durable.DurableTier):
    """The tier in tmp_path, but step 2's commit waits (as for another node's part) until step 1 is committed."""

    def __init__(self, inner: durable.DurableTier) -> None:
        self.inner, self.location, self.options = inner, inner.location, inner.options
        self.tries: list[tuple[int | None, str | None]] = []

    def upload(self, ckpt_dir, *, on_part=None, node=None):  # type: ignore[no-untyped-def]
        step = layout.parse_step_dirname(Path(ckpt_dir).name)
        self.tries.append((step, node))
        if step == 2 and 1 not in self.inner.committed_steps():
            raise DurableWaitError("step 2: waiting for node node-b's part (no marker yet)")
        return self.inner.upload(ckpt_dir, on_part=on_part)

    def list_checkpoints(self, *, deep=False):  # type: ignore[no-untyped-def]
        return self.inner.list_checkpoints(deep=deep)

    def inspect(self, step, *, deep=False):  # type: ignore[no-untyped-def]
        return self.inner.inspect(step, deep=deep)

    def manifest(self, step):  # type: ignore[no-untyped-def]
        return self.inner.manifest(step)

    def read_range(self, step, token, rel, offset, length):  # type: ignore[no-untyped-def]
        return self.inner.read_range(step, token, rel, offset, length)

    def delete(self, step):  # type: ignore[no-untyped-def]
        return self.inner.delete(step)


def test_a_commit_waiting_for_other_nodes_lets_an_older_checkpoint_go_meanwhile(tmp_path: Path) -> None:
    waits: list[tuple[int, str]] = []
    fake = _WaitsForStep1(durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2)))
    older, newer = (make_fake_checkpoint(tmp_path / "fast", s, default_files(s)) for s in (1, 2))
    with Uploader(
        fake, node="node-a", backoff_initial_s=0.05, on_waiting=lambda s, why, d: waits.append((s, why))
    ) as up:
        up.submit(newer)
        wait_for(lambda: waits, 30, "step 2's upload never waited")
        up.submit(older)
        both = up.wait_durable(1, timeout_s=30) and up.wait_durable(2, timeout_s=30)
    assert both
    assert waits[0] == (2, "step 2: waiting for node node-b's part (no marker yet)")
    assert {node for _, node in fake.tries} == {"node-a"}


def test_a_waiting_commit_counts_as_pending_in_the_status(tmp_path: Path) -> None:
    fake = _WaitsForStep1(durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2)))
    newer = make_fake_checkpoint(tmp_path / "fast", 2, default_files(2))
    with Uploader(fake, node="node-a", backoff_initial_s=0.05) as up:
        up.submit(newer)
        wait_for(lambda: up.status().last_error is not None, 30, "step 2 never waited")
        status = up.status()
    assert 2 in (*status.pending, status.uploading) and "node-b" in (status.last_error or "")


class _Step1NeverCommits(_WaitsForStep1):
    """Step 1's commit waits for ever (another node's part never comes); the others commit."""

    def upload(self, ckpt_dir, *, on_part=None, node=None):  # type: ignore[no-untyped-def]
        step = layout.parse_step_dirname(Path(ckpt_dir).name)
        self.tries.append((step, node))
        if step == 1:
            raise DurableWaitError("step 1: waiting for node node-b's part (no marker yet)")
        return self.inner.upload(ckpt_dir, on_part=on_part)


def test_a_commit_still_waiting_when_a_newer_checkpoint_is_durable_is_dropped_as_superseded(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    fake = _Step1NeverCommits(durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2)))
    older, newer = (make_fake_checkpoint(tmp_path / "fast", s, default_files(s)) for s in (1, 2))
    with Uploader(fake, node="node-a", backoff_initial_s=0.05, on_outcome=outcomes.append) as up:
        up.submit(older)
        wait_for(lambda: up.status().last_error is not None, 30, "step 1 never waited")
        up.submit(newer)
        assert up.wait_durable(2, timeout_s=30)
        wait_for(lambda: len(outcomes) == 2, 30, "step 1 was never given up")
        status = up.status()
    dropped = [o for o in outcomes if not o.committed]
    assert [o.step for o in dropped] == [1] and "superseded: step 2 is durable" in (dropped[0].error or "")
    assert status.pending == ()
