"""The durable tier's uploader in a job whose nodes keep separate fast tiers: a checkpoint whose commit waits for
the other nodes' parts waits again in the queue, and other checkpoints go meanwhile (supervisor/durable/upload.py)."""

from __future__ import annotations

from pathlib import Path

from ftsup.store import durable, layout
from ftsup.store.errors import DurableWaitError
from ftsup.supervisor.durable.upload import Outcome, Uploader
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


class _Follows(_WaitsForStep1):
    """The tier's `follows` answers from `verdicts` (step -> "go", "skip", "follow" or "wait"); uploads commit."""

    def __init__(self, inner: durable.DurableTier, verdicts: dict[int, str]) -> None:
        super().__init__(inner)
        self.verdicts = verdicts

    def follows(self, ckpt_dir, node, picked):  # type: ignore[no-untyped-def]
        verdict = self.verdicts[layout.parse_step_dirname(Path(ckpt_dir).name) or 0]
        if verdict == "wait":
            raise DurableWaitError("not picked by node node-a (rank 0) yet")
        return verdict

    def upload(self, ckpt_dir, *, on_part=None, node=None):  # type: ignore[no-untyped-def]
        self.tries.append((layout.parse_step_dirname(Path(ckpt_dir).name), node))
        return self.inner.upload(ckpt_dir, on_part=on_part)


def test_a_checkpoint_not_this_nodes_to_upload_is_skipped_quietly(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    fake = _Follows(durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2)), {1: "skip"})
    ckpt = make_fake_checkpoint(tmp_path / "fast", 1, default_files(1))
    with Uploader(fake, node="node-a", backoff_initial_s=0.05, on_outcome=outcomes.append) as up:
        up.submit(ckpt, picked=False)
        wait_for(lambda: outcomes, 30, "step 1 had no outcome")
    assert [(o.step, o.committed, o.skipped) for o in outcomes] == [(1, False, True)] and fake.tries == []


def test_a_step_waiting_for_the_leaders_pick_is_uploaded_once_it_comes(tmp_path: Path) -> None:
    verdicts = {1: "wait"}
    fake = _Follows(durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2)), verdicts)
    ckpt = make_fake_checkpoint(tmp_path / "fast", 1, default_files(1))
    with Uploader(fake, node="node-b", backoff_initial_s=0.05) as up:
        up.submit(ckpt, picked=False)
        wait_for(lambda: up.status().following == (1,), 30, "step 1 never waited for the leader")
        quiet = up.status().last_error
        verdicts[1] = "follow"
        assert up.wait_durable(1, timeout_s=30)
    assert quiet is None and fake.tries == [(1, "node-b")]


def test_a_step_the_leader_never_picks_is_dropped_quietly_once_two_newer_ones_are_durable(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    verdicts = {1: "wait", 2: "go", 3: "go"}
    fake = _Follows(durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2)), verdicts)
    ckpts = [make_fake_checkpoint(tmp_path / "fast", s, default_files(s)) for s in (1, 2, 3)]
    with Uploader(fake, node="node-b", backoff_initial_s=0.05, on_outcome=outcomes.append) as up:
        up.submit(ckpts[0], picked=False)
        wait_for(lambda: up.status().following == (1,), 30, "step 1 never waited for the leader")
        up.submit(ckpts[1])
        assert up.wait_durable(2, timeout_s=30)
        # `following` counts a step once it was tried since the newest commit: step 1's next try comes after step 2's
        wait_for(lambda: up.status().following == (1,), 30, "step 1 was not tried again after step 2 became durable")
        assert [o.step for o in outcomes] == [2]  # one newer durable step gives up nothing
        up.submit(ckpts[2])
        wait_for(lambda: len(outcomes) == 3, 30, "step 1 was never given up")
        status = up.status()
    assert sorted((o.step, o.committed, o.skipped) for o in outcomes) == [
        (1, False, True),
        (2, True, False),
        (3, True, False),
    ]
    assert status.pending == () and (1, "node-b") not in fake.tries
