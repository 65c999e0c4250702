"""A checkpoint of format_version 1 stays readable: `tests/fixtures/checkpoint-format1/` holds one, as files.

Files, not a writer in the test: that writer would be today's code, checking only that today's code reads what it
writes. They were written once by the engine of format 1 (`fixture_state()` below, step 7, with the options and
arguments the last test passes) and must load, exactly, whatever format a later ftsup writes; while the format is
1, today's writer must write the same bytes (but the manifest's creation time), so that a change of the format
that does not bump its version fails here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ftsup.store import layout
from ftsup.trainer.checkpoint import CheckpointEngine

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "checkpoint-format1"
STEP_DIR = "step-000000007"
FIXTURE_METADATA = {"step": 7, "note": "format 1 fixture"}


def fixture_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(20)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "b": torch.arange(5, dtype=torch.int64),
            "h": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        },
        "extra": {"epoch": 3, "name": "fixture", "lr": 0.25, "ids": [1, 2, 3]},
    }


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    return root


def test_the_format_1_fixture_passes_the_deep_check(tmp_path: Path) -> None:
    info = layout.inspect_checkpoint(_copy(tmp_path) / STEP_DIR, deep=True)
    assert info.consistent, info.problems
    assert json.loads((FIXTURE / STEP_DIR / layout.MANIFEST_NAME).read_text())["format_version"] == 1


def test_the_format_1_fixture_loads_exactly(tmp_path: Path) -> None:
    state: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in fixture_state()["model"].items()},
        "extra": {},
    }
    engine = CheckpointEngine(_copy(tmp_path), o_direct=False, recycle=False, durable_tier=None)
    try:
        result = engine.load(state)
    finally:
        engine.close()
    expected = fixture_state()
    assert result.step == 7 and dict(result.metadata) == FIXTURE_METADATA and result.rank_state == {"seed": 11}
    for k, v in expected["model"].items():
        assert state["model"][k].dtype == v.dtype and torch.equal(state["model"][k], v), k
    assert state["extra"] == expected["extra"]


def test_todays_writer_writes_the_format_1_fixture_s_bytes(tmp_path: Path) -> None:
    engine = CheckpointEngine(tmp_path, o_direct=False, recycle=False, durable_tier=None)
    try:
        engine.save(7, fixture_state(), rank_state={"seed": 11}, metadata=FIXTURE_METADATA, block=True)
    finally:
        engine.close()
    ours, theirs = tmp_path / STEP_DIR, FIXTURE / STEP_DIR
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for name in (p.name for p in theirs.iterdir() if p.name != layout.MANIFEST_NAME):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    mine, fixture = (json.loads((d / layout.MANIFEST_NAME).read_text()) for d in (ours, theirs))
    mine.pop("created_unix"), fixture.pop("created_unix")
    assert mine == fixture
