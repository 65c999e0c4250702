"""A load from a copy holding only some files of a checkpoint (a peer restore's, `peerload.Restored.held`): a file
its plan reads that the copy lacks is a corrupt copy naming that file, passed over for the store's, never a silent
wrong load; a copy holding what the plan reads is read as the whole checkpoint would be."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import torch
from structlog.testing import capture_logs

from ftsup.store import layout
from ftsup.trainer.checkpoint import CheckpointEngine, loading
from ftsup.trainer.checkpoint.comm import LocalComm
from ftsup.trainer.checkpoint.peerload import Restored


def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {"w": torch.arange(8.0), "b": torch.ones(3)}
    with CheckpointEngine(tmp_path / "ckpt", memory=None, durable_tier=None, fallback_dir=None) as engine:
        engine.save(3, state, rank_state={"r": 0}).wait()
    return tmp_path / "ckpt" / layout.step_dirname(3), state


def load_from(
    path: Path, held: set[str]
) -> tuple[loading.LoadResult, list[MutableMapping[str, Any]], dict[str, torch.Tensor]]:
    target = {"w": torch.zeros(8), "b": torch.zeros(3)}
    restored = Restored(path, 3, "peers", frozenset(held))
    with capture_logs() as logs:
        result = loading.load(path.parent, LocalComm(), target, step=None, at_most=None, check=None, restored=restored)
    return result, logs, target


def test_a_shard_the_copy_lacks_is_an_error_naming_it_and_the_store_is_read(tmp_path: Path) -> None:
    path, state = saved(tmp_path)
    held = set(layout.read_manifest(path).files) - {layout.shard_name(0)}
    result, logs, target = load_from(path, held)
    [passed] = [e for e in logs if e["event"] == "checkpoint_peer_passed_over"]
    assert f"{layout.shard_name(0)} is not in this copy" in passed["reason"], passed
    assert (result.tier, torch.equal(target["w"], state["w"]), torch.equal(target["b"], state["b"])) == (
        "fast",
        True,
        True,
    )


def test_a_rank_state_the_copy_lacks_is_an_error_naming_it_and_the_store_is_read(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    result, logs, _ = load_from(path, set(layout.read_manifest(path).files) - {layout.rank_state_name(0)})
    [passed] = [e for e in logs if e["event"] == "checkpoint_peer_passed_over"]
    assert f"{layout.rank_state_name(0)} is not in this copy" in passed["reason"] and result.tier == "fast", passed


def test_a_copy_holding_every_file_the_plan_reads_is_read(tmp_path: Path) -> None:
    path, state = saved(tmp_path)
    result, logs, target = load_from(path, set(layout.read_manifest(path).files))
    assert (result.tier, result.rank_state, torch.equal(target["w"], state["w"])) == ("peers", {"r": 0}, True)
    assert not [e for e in logs if e["event"] == "checkpoint_peer_passed_over"]
