"""A load's `load_s` counts from when the engine's load began when told (the copy made from the peers' memories
before the read is a part of the load), else from the read's own start."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ftsup.trainer.checkpoint import CheckpointEngine, loading
from ftsup.trainer.checkpoint.comm import LocalComm


def test_load_s_counts_from_the_given_start(tmp_path: Path) -> None:
    state = {"w": torch.arange(8.0)}
    with CheckpointEngine(tmp_path / "ckpt", memory=None, durable_tier=None, fallback_dir=None) as engine:
        engine.save(3, state).wait()
    target = {"w": torch.zeros(8)}
    args = (tmp_path / "ckpt", LocalComm(), target)
    plain = loading.load(*args, step=None, at_most=None, check=None)
    earlier = loading.load(*args, step=None, at_most=None, check=None, started=time.perf_counter() - 60.0)
    assert (plain.step, plain.load_s < 60.0, earlier.load_s >= 60.0) == (3, True, True)
    assert torch.equal(target["w"], state["w"])
