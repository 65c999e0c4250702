"""The durable tier's uploader (supervisor/durable/upload.py) on a durable tier in tmp_path: a thread that uploads
what it is given, drops what cannot go, and stops when closed. Its retries of a store that is down: on a real S3
store, tests/integration/test_durable_uploader.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ftsup.store import durable, layout
from ftsup.supervisor.durable.upload import Outcome, Uploader
from tests.helpers import default_files, flip_byte, make_fake_checkpoint
from tests.procs import wait_for


def tier(tmp_path: Path) -> durable.DurableTier:
    return durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2))


def test_a_submitted_checkpoint_becomes_durable_and_is_reported(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    local = make_fake_checkpoint(tmp_path / "fast", 8, default_files())
    with Uploader(tier(tmp_path), on_outcome=outcomes.append) as up:
        up.submit(local)
        became = up.wait_durable(8, timeout_s=30)
        status = up.status()
    assert (became, status.newest_durable, status.pending, status.last_error) == (True, 8, (), None)
    assert [(o.step, o.committed, o.attempts) for o in outcomes] == [(8, True, 1)]
    assert layout.inspect_checkpoint(tmp_path / "durable" / "step-000000008", deep=True).consistent


def test_a_local_checkpoint_that_does_not_verify_is_dropped_and_reported(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    local = make_fake_checkpoint(tmp_path / "fast", 9, default_files())
    flip_byte(local / "shard-00001.safetensors", 3)
    with Uploader(tier(tmp_path), on_outcome=outcomes.append) as up:
        up.submit(local)
        wait_for(lambda: outcomes, 30, "no outcome for the upload")
        became = up.wait_durable(9, timeout_s=30)
    assert (became, outcomes[0].committed) == (False, False)
    assert "shard-00001.safetensors: checksum" in (outcomes[0].error or "")


def test_a_step_already_durable_is_not_uploaded_again(tmp_path: Path) -> None:
    outcomes: list[Outcome] = []
    local = make_fake_checkpoint(tmp_path / "fast", 4, default_files())
    with Uploader(tier(tmp_path), on_outcome=outcomes.append) as up:
        up.submit(local)
        up.wait_durable(4, timeout_s=30)
        up.submit(local)
        status = up.status()
    assert (len(outcomes), status.pending) == (1, ())


def test_closing_stops_the_thread(tmp_path: Path) -> None:
    up = Uploader(tier(tmp_path))
    up.close()
    assert not up.alive


class _Blocking(durable.DurableTier):
    """The tier in tmp_path, but step 1's upload sends parts until told to go on, and step 3's raises a bug."""

    def __init__(self, inner: durable.DurableTier) -> None:
        self.inner, self.location, self.options = inner, inner.location, inner.options
        self.go = threading.Event()
        self.parts = 0

    def upload(self, ckpt_dir, *, on_part=None):  # type: ignore[no-untyped-def]
        step = layout.parse_step_dirname(Path(ckpt_dir).name)
        if step == 3:
            raise RuntimeError("a bug on a hostile answer")
        while step == 1 and not self.go.wait(0.01):
            self.parts += 1
            if on_part is not None:
                on_part("shard", self.parts)
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


def test_an_urgent_checkpoint_goes_before_the_upload_in_progress_which_goes_on_after(tmp_path: Path) -> None:
    slow = _Blocking(tier(tmp_path))
    started: list[int] = []
    first, urgent = (make_fake_checkpoint(tmp_path / "fast", s, default_files(s)) for s in (1, 2))
    with Uploader(slow, on_started=lambda step, path: started.append(step)) as up:
        up.submit(first)
        wait_for(lambda: slow.parts > 0, 30, "step 1's upload never started")
        up.submit(urgent, urgent=True)
        became = up.wait_durable(2, timeout_s=30)
        before = up.wait_durable(1, timeout_s=0)
        slow.go.set()
        after = up.wait_durable(1, timeout_s=30)
    assert (became, before, after, started) == (True, False, True, [1, 2, 1])


def test_any_exception_of_an_upload_drops_that_checkpoint_only(tmp_path: Path) -> None:
    slow = _Blocking(tier(tmp_path))
    slow.go.set()
    outcomes: list[Outcome] = []
    bad, good = (make_fake_checkpoint(tmp_path / "fast", s, default_files(s)) for s in (3, 4))
    with Uploader(slow, on_outcome=outcomes.append) as up:
        up.submit(bad)
        wait_for(lambda: outcomes, 30, "no outcome for step 3")
        up.submit(good)
        became = up.wait_durable(4, timeout_s=30)
    assert (became, [(o.step, o.committed, o.error) for o in outcomes]) == (
        True,
        [(3, False, "RuntimeError: a bug on a hostile answer"), (4, True, None)],
    )


def test_past_max_pending_the_oldest_waiting_checkpoint_is_dropped(tmp_path: Path) -> None:
    slow = _Blocking(tier(tmp_path))
    outcomes: list[Outcome] = []
    first, *waiting = (make_fake_checkpoint(tmp_path / "fast", s, default_files(s)) for s in (1, 5, 6, 7))
    with Uploader(slow, on_outcome=outcomes.append, max_pending=2) as up:
        up.submit(first)
        wait_for(lambda: slow.parts > 0, 30, "step 1's upload never started")
        queued = [up.submit(w) for w in waiting]
        pending = up.status().pending
        slow.go.set()
    first_out = [(o.step, o.committed) for o in outcomes][:1]
    assert (queued, pending, first_out) == ([True, True, True], (7, 6), [(5, False)])
    assert "superseded" in (outcomes[0].error or "")


def test_the_uploads_run_at_a_lower_cpu_priority_than_the_caller(tmp_path: Path) -> None:
    seen: list[int] = []
    local = make_fake_checkpoint(tmp_path / "fast", 2, default_files())
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def hook(step: int, path: str) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    with Uploader(tier(tmp_path), on_started=hook, nice=3) as up:
        up.submit(local)
        up.wait_durable(2, timeout_s=30)
    assert (seen, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == ([min(19, mine + 3)], mine)
