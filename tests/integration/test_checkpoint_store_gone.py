"""The engine's store vanishing or refusing mid-run, in one process: a directory that vanished is made again by the
next save (logged), one that cannot be fails that save naming the directory and the fix while later saves go on,
and an emergency save the store refuses is committed in the fallback directory."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from ftsup.store import layout
from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointSaveError
from tests.helpers import mounted_tmpfs
from tests.integration.test_checkpoint_engine import make_state, same, snapshot


def step_of(info: layout.CheckpointInfo | None) -> int | None:
    return None if info is None else info.step


def test_a_vanished_directory_is_made_again_by_the_next_save_and_logged(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    with CheckpointEngine(store, fallback_dir=None) as engine:
        state = make_state()
        engine.save(1, {"app": state}, block=True)
        shutil.rmtree(store)
        with structlog.testing.capture_logs() as logs:
            result = engine.save(2, {"app": state}, block=True)
    assert (result.recreated, step_of(layout.latest_consistent(store, deep=True))) == (True, 2)
    (made,) = [e for e in logs if e["event"] == "checkpoint_dir_recreated"]
    assert (made["step"], made["path"], made["log_level"]) == (2, str(store), "warning")


def test_a_save_into_a_directory_still_there_says_nothing_was_made(tmp_path: Path) -> None:
    with CheckpointEngine(tmp_path / "ckpt", fallback_dir=None) as engine:
        assert engine.save(1, {"app": make_state()}, block=True).recreated is False


def test_a_file_in_its_place_fails_the_save_naming_the_fix_and_the_next_save_goes_on(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    with CheckpointEngine(store, fallback_dir=None) as engine:
        state = make_state()
        engine.save(1, {"app": state}, block=True)
        shutil.rmtree(store)
        store.write_text("not a store")
        with pytest.raises(CheckpointSaveError, match=f"the checkpoint directory {store} is not a directory; move"):
            engine.save(2, {"app": state}, block=True)
        store.unlink()
        engine.save(3, {"app": state}, block=True)
        assert engine.failed_saves == 1
    assert step_of(layout.latest_consistent(store)) == 3


def test_a_link_to_nothing_in_its_place_is_never_followed(tmp_path: Path) -> None:
    store, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    with CheckpointEngine(store, fallback_dir=None) as engine:
        shutil.rmtree(store)
        store.symlink_to(elsewhere)
        with pytest.raises(CheckpointSaveError, match="a link to nothing, or something that is not a directory"):
            engine.save(1, {"app": make_state()}, block=True)
    assert not elsewhere.exists()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}", "16m")


def test_a_directory_that_cannot_be_made_again_fails_the_save_naming_why(tmpfs: Path) -> None:
    store = tmpfs / "ckpt"
    with CheckpointEngine(store, fallback_dir=None) as engine:
        shutil.rmtree(store)
        assert subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)]).returncode == 0
        why = f"vanished and cannot be made again [(]{store}: is on a read-only file system[)]; make its parent"
        with pytest.raises(CheckpointSaveError, match=why):
            engine.save(1, {"app": make_state()}, block=True)


def test_an_emergency_save_the_store_refuses_is_committed_in_the_fallback_directory(tmpfs: Path, tmp_path) -> None:
    store, fallback = tmpfs / "ckpt", tmp_path / "fallback"
    with CheckpointEngine(store, fallback_dir=fallback) as engine:
        state = make_state()
        engine.save(1, {"app": state}, block=True)
        assert subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)]).returncode == 0
        with structlog.testing.capture_logs() as logs:
            result = engine.save(2, {"app": state}, kind="emergency", block=True)
        assert (result.fallback, result.path) == (True, str(fallback / layout.step_dirname(2)))
        with pytest.raises(CheckpointSaveError):  # a periodic save has no second try: it is a resume point or none
            engine.save(3, {"app": state}, block=True)
    assert [e["event"] for e in logs if e["event"].startswith("checkpoint_")] == [
        "checkpoint_save_failed",
        "checkpoint_committed",
    ]
    assert step_of(layout.latest_consistent(store)) == 1
    saved = snapshot(state)
    with torch.no_grad():
        for p in state.model.parameters():
            p.zero_()
    with CheckpointEngine(fallback, fallback_dir=None) as reader:
        assert reader.load({"app": state}).step == 2
    assert same(snapshot(state), saved)
