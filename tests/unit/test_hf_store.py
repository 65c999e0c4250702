"""A Trainer's `checkpoint-N/` committed into the store (`ftsup.trainer.hf.store`), and the resume
choice over it: only a committed, verified directory is ever resumed from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ftsup.store import layout
from ftsup.store.errors import CheckpointSaveError
from ftsup.trainer.hf.store import commit_hf_checkpoint, hf_checkpoint_dir, latest_hf_checkpoint
from tests.helpers import flip_byte


def trainer_save(output_dir: Path, step: int) -> Path:
    """What the Trainer writes for a step (the files' names; their bytes do not matter here)."""
    d = hf_checkpoint_dir(output_dir, step)
    d.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        (d / name).write_bytes(os.urandom(3000) + name.encode())
    (d / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return d


def commit(out: Path, store: Path, step: int) -> None:
    commit_hf_checkpoint(hf_checkpoint_dir(out, step), store, step, kind="periodic", world_size=2, metadata={})


def test_a_torn_save_is_never_the_resume_point_a_committed_one_is(tmp_path):
    out, store = tmp_path / "out", tmp_path / "store"
    trainer_save(out, 10)
    commit(out, store, 10)
    trainer_save(store, 20)  # the Trainer's own directory of a later step, never committed
    (store / layout.partial_dirname(30)).mkdir()  # a commit torn by a crash
    info, passed = latest_hf_checkpoint(store)
    assert (info.step, info.path, passed) == (10, str(store / "step-000000010"), ())
    manifest = layout.read_manifest(info.path)
    assert manifest.metadata["format"] == "hf-trainer" and "trainer_state.json" in manifest.files


def test_a_corrupt_newest_checkpoint_is_quarantined_and_the_one_before_resumed(tmp_path):
    out, store = tmp_path / "out", tmp_path / "store"
    for step in (10, 20):
        trainer_save(out, step)
        commit(out, store, step)
    flip_byte(store / "step-000000020" / "optimizer.pt", 100)
    info, passed = latest_hf_checkpoint(store)
    assert info.step == 10
    assert [(p.step, p.action) for p in passed] == [(20, "quarantined")]
    assert (store / "step-000000020.corrupt").is_dir()


def test_a_link_in_the_trainers_directory_fails_the_commit_and_leaves_no_checkpoint(tmp_path):
    out, store = tmp_path / "out", tmp_path / "store"
    d = trainer_save(out, 10)
    (d / "pwned").symlink_to("/etc/passwd")
    with pytest.raises(CheckpointSaveError, match="neither a file nor a directory"):
        commit(out, store, 10)
    assert os.listdir(store) == []
