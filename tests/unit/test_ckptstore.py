"""The daemon's view of the checkpoint store, read on a thread of its own: results handed over,
an unchanged store barely touched, a hostile or failing store counted and survived."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import checksums, choice, layout
from ftsup.supervisor.state import ckptstore
from ftsup.supervisor.state.ckptstore import StoreScanner, StoreView
from tests.helpers import default_files, make_fake_checkpoint, slow_choices, torn_newest
from tests.procs import wait_for


@pytest.fixture
def scanner(tmp_path: Path) -> Iterator[StoreScanner]:
    s = StoreScanner(tmp_path / "ckpt", interval_s=0.05).start()
    yield s
    s.close()


def view_after(s: StoreScanner, scans: int) -> StoreView:
    """The first view of at least `scans` scans (polled with a deadline)."""

    def ready() -> StoreView | None:
        v = s.view()
        return v if v.scans >= scans else None

    return wait_for(ready, 10, lambda: f"stuck at {s.view()}")


def test_a_scan_reports_the_newest_consistent_checkpoint_and_the_count(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 100, default_files(1))
    broken = make_fake_checkpoint(tmp_path / "ckpt", 200, default_files(2))
    (broken / "shard-00000.safetensors").write_bytes(b"torn")
    # Started on the finished store: one scanning while step 200 was whole would keep that result, the listing
    # unchanged by the tear (`test_an_unchanged_store_is_not_checked_again`).
    scanner = StoreScanner(tmp_path / "ckpt", interval_s=0.05).start()
    try:
        first = view_after(scanner, 1)
        wait_for(lambda: scanner.view().committed == 2, 10, "the checkpoints never showed")
        view = scanner.view()
    finally:
        scanner.close()
    assert (view.latest.step if view.latest else None, view.committed, view.errors) == (100, 2, 0)
    assert first.scans >= 1 and broken.is_dir()  # a scan never quarantines


def test_a_new_checkpoint_shows_at_the_next_scan(tmp_path: Path, scanner: StoreScanner) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 100, default_files(1))
    wait_for(lambda: (v := scanner.view().latest) and v.step == 100, 10, "step 100 never showed")
    make_fake_checkpoint(tmp_path / "ckpt", 200, default_files(2))
    wait_for(lambda: (v := scanner.view().latest) and v.step == 200, 10, "step 200 never showed")


def test_an_unchanged_store_is_not_checked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (100, 200):
        make_fake_checkpoint(tmp_path / "ckpt", step, default_files(step))
    checked: list[str] = []
    real = layout.inspect_checkpoint

    def counting(path: Any, **kw: Any) -> layout.CheckpointInfo:
        checked.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(ckptstore.layout, "inspect_checkpoint", counting)
    s = StoreScanner(tmp_path / "ckpt", interval_s=0.01).start()
    try:
        view_after(s, 20)
        assert checked == ["step-000000200"]  # once, newest first, and the scan stopped there
        staged = make_fake_checkpoint(tmp_path / "staging", 300, default_files(300))
        staged.rename(tmp_path / "ckpt" / staged.name)  # committed whole, as the commit protocol does
        wait_for(lambda: (v := s.view().latest) and v.step == 300, 10, "step 300 never showed")
        (tmp_path / "ckpt" / "step-000000300" / "shard-00001.safetensors").unlink()  # changed: checked again
        wait_for(lambda: (v := s.view().latest) and v.step == 200, 10, "the broken step 300 was still the latest")
        view_after(s, s.view().scans + 5)
        assert checked == ["step-000000200", "step-000000300", "step-000000300"]
    finally:
        s.close()


def _plant_hostile(root: Path) -> None:
    """A FIFO manifest, one nested 5000 deep, and one of 150,000 entries, all newer than the good ones."""
    fifo = make_fake_checkpoint(root, 97, default_files(3))
    (fifo / layout.MANIFEST_NAME).unlink()
    os.mkfifo(fifo / layout.MANIFEST_NAME)
    nested = make_fake_checkpoint(root, 98, default_files(4))
    (nested / layout.MANIFEST_NAME).write_bytes(b'{"files": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    huge = make_fake_checkpoint(root, 99, default_files(5))
    obj = json.loads((huge / layout.MANIFEST_NAME).read_text())
    entry = {"size": 1, "checksum": checksums.checksum_bytes(b"x")}
    obj["files"].update({f"shard-{i:06d}.safetensors": entry for i in range(150_000)})
    (huge / layout.MANIFEST_NAME).write_text(json.dumps(obj))


def test_a_hostile_store_is_scanned_without_a_failure_and_its_good_checkpoint_found(
    tmp_path: Path, scanner: StoreScanner
) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 50, default_files(1))
    _plant_hostile(tmp_path / "ckpt")
    wait_for(lambda: (v := scanner.view().latest) and v.step == 50, 30, lambda: f"not found: {scanner.view()}")
    assert scanner.view().errors == 0
    resume = scanner.choose(timeout_s=30)
    assert resume.picked.info is not None and resume.picked.info.step == 50
    assert [(p.step, p.action) for p in resume.picked.passed] == [
        (99, "quarantined"),
        (98, "quarantined"),
        (97, "quarantined"),
    ]


def test_a_failing_store_is_counted_and_the_scanner_goes_on(tmp_path: Path, scanner: StoreScanner) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 100, default_files(1))
    wait_for(lambda: (v := scanner.view().latest) and v.step == 100, 10, "step 100 never showed")
    (tmp_path / "ckpt").rename(tmp_path / "away")
    (tmp_path / "ckpt").write_text("a file where the directory was")
    failed = wait_for(lambda: scanner.view() if scanner.view().errors else None, 10, "no failure counted")
    assert "NotADirectoryError" in (failed.last_error or "") and failed.latest and failed.latest.step == 100
    (tmp_path / "ckpt").unlink()
    (tmp_path / "away").rename(tmp_path / "ckpt")
    settled = view_after(scanner, scanner.view().scans + 2)  # every scan begun before the restore has ended
    after = view_after(scanner, settled.scans + 3)
    assert after.errors == settled.errors and after.latest and after.latest.step == 100


def test_the_resume_choice_quarantines_what_is_broken_by_its_own_name(tmp_path: Path, scanner: StoreScanner) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 100, default_files(1), metadata={"global_batch": 8})
    odd = make_fake_checkpoint(tmp_path / "ckpt", 200, default_files(2)).rename(tmp_path / "ckpt" / "step-0000000200")
    (odd / "shard-00000.safetensors").write_bytes(b"torn")
    resume = scanner.choose(timeout_s=10)
    assert (resume.answered, resume.picked.info.step if resume.picked.info else None) == (True, 100)
    assert resume.metadata == {"global_batch": 8}
    assert [Path(p.moved_to or "").name for p in resume.picked.passed] == ["step-0000000200.corrupt"]


def test_a_resume_choice_that_takes_too_long_is_left_to_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def stuck(*args: Any, **kw: Any) -> choice.Choice:  # a store that does not answer (a hung mount)
        release.wait(30)
        return choice.Choice(None)

    monkeypatch.setattr(ckptstore.choice, "choose", stuck)
    s = StoreScanner(tmp_path / "ckpt", interval_s=0.05).start()
    try:
        resume = s.choose(timeout_s=0.2)
        assert (resume.answered, resume.quiet, "nothing within 0.2s" in resume.why_no_checkpoint) == (
            False,
            False,
            True,
        )
    finally:
        release.set()
        s.close()


def test_close_stops_the_thread(tmp_path: Path) -> None:
    s = StoreScanner(tmp_path / "ckpt", interval_s=60).start()
    s.close(timeout_s=5)
    assert not any(t.name == "ftsup-ckpt-scan" and t.is_alive() for t in threading.enumerate())


def test_a_big_manifest_is_checked_in_a_child_process_with_the_same_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = make_fake_checkpoint(tmp_path, 100, default_files(1), metadata={"step": 100})
    newer = make_fake_checkpoint(tmp_path, 200, default_files(2))
    obj = json.loads((newer / layout.MANIFEST_NAME).read_text())
    (newer / layout.MANIFEST_NAME).write_text(json.dumps(dict(obj, format_version=99)))
    for ckpt in (good, newer):
        here, there = layout.inspect_checkpoint(ckpt), ckptstore._inspect_in_child(ckpt)
        assert (there.to_json(), there.tensor_bytes) == (here.to_json(), here.tensor_bytes)
    assert ckptstore._inspect_in_child(newer).unknown_format is True
    monkeypatch.setattr(ckptstore, "_CHILD", "import sys; sys.exit(3)")
    failed = ckptstore._inspect_in_child(good)
    assert (failed.consistent, "could not be checked" in str(failed.problems[0])) == (False, True)


def test_the_scanner_sends_manifests_past_the_threshold_to_a_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 100, default_files(1))
    children: list[Path] = []
    real = ckptstore._inspect_in_child
    monkeypatch.setattr(ckptstore, "CHILD_CHECK_BYTES", 1)  # every manifest is "big"

    def in_child(p: Path) -> layout.CheckpointInfo:
        children.append(p)
        return real(p)

    monkeypatch.setattr(ckptstore, "_inspect_in_child", in_child)
    s = StoreScanner(tmp_path / "ckpt", interval_s=0.05).start()
    try:
        wait_for(lambda: (v := s.view().latest) and v.step == 100, 30, lambda: f"not found: {s.view()}")
    finally:
        s.close()
    assert [p.name for p in children] == ["step-000000100"]


def test_a_resume_choice_made_after_its_caller_gave_up_is_handed_on_with_what_it_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torn_newest(tmp_path / "ckpt")
    release = slow_choices(monkeypatch)  # a store slow to answer (a loaded mount), then answering
    s = StoreScanner(tmp_path / "ckpt", interval_s=0.05).start()
    try:
        assert s.choose(timeout_s=0.2, tag=7).answered is False
        assert s.take_late() == []
        release.set()
        late = wait_for(lambda: s.take_late() or None, 10, "the late choice was never handed on")
    finally:
        release.set()
        s.close()
    assert [(tag, r.picked.info.step if r.picked.info else None) for tag, r in late] == [(7, 100)]
    assert [(p.step, p.action) for p in late[0][1].picked.passed] == [(200, choice.QUARANTINED)]
    assert s.take_late() == []
