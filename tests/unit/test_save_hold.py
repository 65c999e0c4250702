"""The durable upload's hold while the node's fast tier is being written (supervisor/durable/hold.py), and the
uploader's use of it (supervisor/durable/upload.py): held while a `step-N.partial` is there, going on once it is
committed, never held for ever by a torn one, never held when urgent."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

import pytest

from ftsup.store import durable, layout
from ftsup.supervisor.durable.hold import SaveHold
from ftsup.supervisor.durable.upload import Outcome, Uploader
from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import wait_for


def _saving(fast: Path, step: int) -> Path:
    partial = fast / layout.partial_dirname(step)
    partial.mkdir(parents=True)
    return partial


def _waiter(hold: SaveHold) -> threading.Thread:
    t = threading.Thread(target=hold.wait, daemon=True)
    t.start()
    return t


def test_nothing_being_written_holds_nothing(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path, 3, default_files())
    hold = SaveHold(tmp_path)
    hold()
    assert (hold.writing(), hold.held_s) == (False, 0.0)
    assert not SaveHold(tmp_path / "missing").writing()  # a folder that cannot be read holds nothing


def test_a_save_in_flight_holds_until_it_is_committed(tmp_path: Path) -> None:
    partial = _saving(tmp_path, 5)
    hold = SaveHold(tmp_path)
    t = _waiter(hold)
    wait_for(lambda: hold.writing() and t.is_alive(), 10, "the hold did not see the save")
    t.join(0.2)
    assert t.is_alive()  # still held while the save is being written
    partial.rename(tmp_path / layout.step_dirname(5))
    t.join(10)
    assert (t.is_alive(), hold.held_s > 0) == (False, True)


def test_a_torn_partial_holds_for_at_most_max_hold_s_then_never_again(tmp_path: Path) -> None:
    _saving(tmp_path, 5)
    hold = SaveHold(tmp_path, max_hold_s=0.3)
    t = _waiter(hold)
    t.join(30)
    assert (t.is_alive(), 0.25 <= hold.held_s < 10) == (False, True)
    held = hold.held_s
    hold()  # the same torn one: seen for longer than max_hold_s, holds nothing now
    assert (hold.writing(), hold.held_s) == (False, held)
    _saving(tmp_path, 6)  # a new save holds again
    wait_for(hold.writing, 10, "the new save was not seen")


def _four_held_for(hold: SaveHold, partial: Path, seconds: float) -> list[threading.Thread]:
    """Four waiters held by the save being written in `partial` for at least `seconds`, then its commit; the
    waiters once they all ended."""
    waiters = [_waiter(hold) for _ in range(4)]
    wait_for(lambda: hold.writing() and all(t.is_alive() for t in waiters), 10, "the hold did not see the save")
    waiters[0].join(seconds)
    partial.rename(partial.parent / layout.step_dirname(5))
    for t in waiters:
        t.join(10)
    assert not any(t.is_alive() for t in waiters)
    return waiters


def test_threads_held_together_count_their_wall_time_once(tmp_path: Path) -> None:
    partial = _saving(tmp_path, 5)
    hold = SaveHold(tmp_path)
    started = time.monotonic()
    _four_held_for(hold, partial, 0.3)
    elapsed = time.monotonic() - started
    assert 0.3 <= hold.held_s <= elapsed  # four threads held together: their wall time, not four times it


def test_threads_held_together_sleep_while_one_of_them_watches_the_fast_tier(tmp_path: Path) -> None:
    """One waiter looks at the fast tier every POLL_S for all of them; the others wake when it sees the save end
    (a look at the clock is a wake-up: the watcher makes dozens in a second, the others a handful)."""
    partial = _saving(tmp_path, 5)
    looks: collections.Counter[int] = collections.Counter()

    def clock() -> float:
        looks[threading.get_ident()] += 1
        return time.monotonic()

    waiters = _four_held_for(SaveHold(tmp_path, clock=clock), partial, 1.0)
    per_thread = sorted(looks[t.ident or 0] for t in waiters)
    assert per_thread[-1] >= 15 and max(per_thread[:-1]) <= 8, per_thread


@pytest.mark.parametrize("how", ["give_up", "stop"])
def test_a_wait_ends_when_the_caller_gives_up_or_the_hold_is_stopped(tmp_path: Path, how: str) -> None:
    _saving(tmp_path, 5)
    hold = SaveHold(tmp_path)
    flag = threading.Event()
    t = threading.Thread(target=hold.wait, kwargs={"give_up": flag.is_set}, daemon=True)
    t.start()
    wait_for(lambda: hold.writing() and t.is_alive(), 10, "the hold did not see the save")
    if how == "give_up":
        flag.set()
    else:
        hold.stop()
    t.join(10)
    assert not t.is_alive()
    assert hold.writing()  # the save is still there: only the wait ended


def test_max_hold_s_must_not_be_negative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_hold_s"):
        SaveHold(tmp_path, max_hold_s=-1)


def _tier(tmp_path: Path) -> durable.DurableTier:
    return durable.open_tier(str(tmp_path / "durable"), durable.DurableOptions(concurrency=2))


def test_the_uploader_holds_a_periodic_upload_while_a_save_is_written_and_leaves_the_hold_out_of_its_rate(
    tmp_path: Path,
) -> None:
    fast = tmp_path / "fast"
    local = make_fake_checkpoint(fast, 8, default_files())
    partial = _saving(fast, 9)
    outcomes: list[Outcome] = []
    with Uploader(_tier(tmp_path), on_outcome=outcomes.append, hold_s=60) as up:
        up.submit(local)
        assert not up.wait_durable(8, timeout_s=0.5)  # held: the save of step 9 is being written
        assert up.status().uploading == 8
        partial.rename(fast / layout.step_dirname(9))
        assert up.wait_durable(8, timeout_s=30)
    assert [(o.step, o.committed) for o in outcomes] == [(8, True)]
    assert outcomes[0].send_s < outcomes[0].duration_s - 0.4  # the held seconds are not the tier's


def test_an_urgent_upload_is_never_held(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    local = make_fake_checkpoint(fast, 8, default_files())
    _saving(fast, 9)
    with Uploader(_tier(tmp_path), hold_s=600) as up:
        up.submit(local, urgent=True)
        assert up.wait_durable(8, timeout_s=30)


def test_without_a_hold_configured_nothing_waits_for_a_save(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    local = make_fake_checkpoint(fast, 8, default_files())
    _saving(fast, 9)
    with Uploader(_tier(tmp_path)) as up:
        up.submit(local)
        assert up.wait_durable(8, timeout_s=30)


def test_closing_the_uploader_ends_a_hold_at_once(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    local = make_fake_checkpoint(fast, 8, default_files())
    _saving(fast, 9)
    up = Uploader(_tier(tmp_path), hold_s=600)
    up.submit(local)
    wait_for(lambda: up.status().uploading == 8, 10, "the upload did not start")
    up.close(timeout_s=30)
    assert not up.alive
