"""Hostile checkpoint stores through the engine: a corrupt or foreign checkpoint is never loaded
(the load falls back to the next older one, or says why there is none), never blocks the load,
and never makes it read or write outside the store."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from ftsup.store import checksums, layout
from ftsup.trainer.checkpoint import (
    CheckpointEngine,
    CheckpointSaveError,
    NoCheckpointError,
    RetentionPolicy,
)
from ftsup.trainer.checkpoint.stateful import ModelOptimState
from tests.helpers import write_manifest_json


def make_state(seed: int = 0) -> ModelOptimState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return ModelOptimState(model, optim)


def weights(state: ModelOptimState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[torch.Tensor], Path]:
    """Steps 1 (good, its weights returned) and 2 (the one each test breaks) under tmp/ckpt."""
    root = tmp_path / "ckpt"
    with CheckpointEngine(root, retention=RetentionPolicy(keep_last=5)) as eng:
        state = make_state()
        eng.save(1, {"app": state}, block=True)
        want = weights(state)
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(1.0)
        eng.save(2, {"app": state}, block=True)
    return root, want, root / layout.step_dirname(2)


def load_latest(root: Path, within_s: float = 60.0) -> tuple[Any, list[torch.Tensor], list[dict[str, Any]]]:
    """Load the latest into a fresh state in a thread (a load that blocks fails the test)."""
    fresh = make_state(seed=7)
    out: list[Any] = []

    def target() -> None:
        try:
            with structlog.testing.capture_logs() as logs, CheckpointEngine(root) as eng:
                out.append((eng.load({"app": fresh}), logs))
        except BaseException as e:
            out.append((e, []))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"the load blocked for over {within_s}s"
    result, logs = out[0]
    return result, weights(fresh), logs


def rewrite(ckpt: Path, rel: str, data: bytes) -> None:
    """Replace one file and record it in the manifest as if it had been saved so (a corruption
    that checksums cannot see); a shard gets a matching block checksum sidecar too."""
    manifest = json.loads((ckpt / layout.MANIFEST_NAME).read_text())
    (ckpt / rel).write_bytes(data)
    manifest["files"][rel] = {"size": len(data), "checksum": checksums.checksum_bytes(data)}
    if rel.endswith(".safetensors"):
        sidecar = rel.removesuffix(".safetensors") + ".crc32"
        packed = checksums.pack_block_crcs(checksums.block_crcs(data))
        (ckpt / sidecar).write_bytes(packed)
        manifest["files"][sidecar] = {"size": len(packed), "checksum": checksums.checksum_bytes(packed)}
    write_manifest_json(ckpt, manifest)


def edit_dcp_metadata(ckpt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    meta = json.loads((ckpt / layout.DCP_META_NAME).read_bytes())
    edit(meta)
    rewrite(ckpt, layout.DCP_META_NAME, json.dumps(meta).encode())


def fell_back_to_step_1(result: Any, got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return getattr(result, "step", None) == 1 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def events(logs: list[dict[str, Any]]) -> list[tuple[str, int | None]]:
    return [(e["event"], e.get("step")) for e in logs if e["event"].startswith("checkpoint_") and e.get("step")]


# --------------------------------------------------------------------------- DCP metadata


def _negative_offset(meta: dict[str, Any]) -> None:
    meta["storage"][0]["byte_offset"] = -4096


def _offset_past_the_end(meta: dict[str, Any]) -> None:
    meta["storage"][0]["byte_offset"] = 1 << 40


def _chunk_outside_its_tensor(meta: dict[str, Any]) -> None:
    first = next(iter(meta["tensors"].values()))
    first["chunks"][0]["offsets"][0] = 10**6


def _undeclared_storage(meta: dict[str, Any]) -> None:
    meta["storage"][0]["offsets"] = [7] * len(meta["storage"][0]["offsets"])


def _file_outside(meta: dict[str, Any]) -> None:
    meta["storage"][0]["file"] = "../step-000000001/shard-00000.safetensors"


def _unknown_dtype(meta: dict[str, Any]) -> None:
    next(iter(meta["tensors"].values()))["dtype"] = "float128"


def _skeleton_names_a_missing_tensor(meta: dict[str, Any]) -> None:
    meta["skeleton"] = {"T": "no.such.tensor"}


def _storage_not_a_list(meta: dict[str, Any]) -> None:
    meta["storage"] = {"a": 1}


@pytest.mark.parametrize(
    "edit",
    [
        _negative_offset,
        _offset_past_the_end,
        _chunk_outside_its_tensor,
        _undeclared_storage,
        _file_outside,
        _unknown_dtype,
        _skeleton_names_a_missing_tensor,
        _storage_not_a_list,
    ],
)
def test_dcp_metadata_with_valid_checksums_but_an_invalid_schema_is_corrupt_and_falls_back(
    saved: tuple[Path, list[torch.Tensor], Path], edit: Callable[[dict[str, Any]], None]
) -> None:
    root, want, broken = saved
    edit_dcp_metadata(broken, edit)
    result, got, logs = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result
    assert ("checkpoint_quarantined", 2) in events(logs)
    assert (root / "step-000000002.corrupt").is_dir()


def test_a_deeply_nested_dcp_metadata_is_corrupt_not_a_recursion_error(
    saved: tuple[Path, list[torch.Tensor], Path],
) -> None:
    root, want, broken = saved
    rewrite(broken, layout.DCP_META_NAME, b"[" * 5000 + b"]" * 5000)
    result, got, _ = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result


def test_a_malformed_rank_state_with_a_valid_checksum_falls_back(saved: tuple[Path, list[torch.Tensor], Path]) -> None:
    root, want, broken = saved
    rewrite(broken, layout.rank_state_name(0), b'{"d": [[1, {"x": 1}]]}')
    result, got, _ = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result


# --------------------------------------------------------------------------- shards and sidecars


@pytest.mark.parametrize("rel", ["shard-00000.safetensors", "shard-00000.crc32", layout.DCP_META_NAME])
def test_a_fifo_in_place_of_a_file_falls_back_without_blocking(
    saved: tuple[Path, list[torch.Tensor], Path], rel: str
) -> None:
    root, want, broken = saved
    size = (broken / rel).stat().st_size
    (broken / rel).unlink()
    os.mkfifo(broken / rel)
    assert json.loads((broken / layout.MANIFEST_NAME).read_text())["files"][rel]["size"] == size > 0
    try:
        result, got, _ = load_latest(root)
    finally:
        for where in (broken, broken.with_name(broken.name + ".corrupt")):
            try:  # let a reader blocked in open() go
                os.close(os.open(where / rel, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert fell_back_to_step_1(result, got, want), result


def test_a_safetensors_header_length_of_2_to_the_63_is_never_loaded(
    saved: tuple[Path, list[torch.Tensor], Path],
) -> None:
    root, want, broken = saved
    shard = broken / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 63)
    shard.write_bytes(bytes(data))  # same size: only the checksums see it
    result, got, _ = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result


def test_a_truncated_shard_is_never_loaded(saved: tuple[Path, list[torch.Tensor], Path]) -> None:
    root, want, broken = saved
    os.truncate(broken / "shard-00000.safetensors", 5000)
    result, got, _ = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result


def test_a_shard_symlinked_out_of_the_store_is_never_read(
    saved: tuple[Path, list[torch.Tensor], Path], tmp_path: Path
) -> None:
    root, want, broken = saved
    outside = tmp_path / "outside.safetensors"
    (broken / "shard-00000.safetensors").rename(outside)
    (broken / "shard-00000.safetensors").symlink_to(outside)
    result, got, _ = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result


# --------------------------------------------------------------------------- manifests


def test_a_checkpoint_of_a_newer_format_is_skipped_and_never_renamed(
    saved: tuple[Path, list[torch.Tensor], Path],
) -> None:
    root, want, newer = saved
    manifest = json.loads((newer / layout.MANIFEST_NAME).read_text())
    write_manifest_json(newer, dict(manifest, format_version=layout.FORMAT_VERSION + 1))
    result, got, logs = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result
    assert ("checkpoint_skipped", 2) in events(logs) and newer.is_dir()


def test_a_manifest_whose_step_differs_from_its_directory_is_never_loaded(
    saved: tuple[Path, list[torch.Tensor], Path],
) -> None:
    root, want, broken = saved
    broken.rename(root / layout.step_dirname(999_999_999_999))
    result, got, _ = load_latest(root)
    assert fell_back_to_step_1(result, got, want), result


def test_when_every_checkpoint_is_unusable_the_error_lists_each(saved: tuple[Path, list[torch.Tensor], Path]) -> None:
    root, _, broken = saved
    (broken / layout.MANIFEST_NAME).write_bytes(b"[" * 5000)
    edit_dcp_metadata(root / layout.step_dirname(1), _negative_offset)
    result, _, _ = load_latest(root)
    assert isinstance(result, NoCheckpointError)
    assert [r.split(":")[0] for r in result.rejected] == [
        "step-000000002 skipped",
        "step-000000001 quarantined (now step-000000001.corrupt)",
    ]


# --------------------------------------------------------------------------- saving over what is there


def test_a_save_over_an_inconsistent_step_quarantines_it_and_commits(
    saved: tuple[Path, list[torch.Tensor], Path],
) -> None:
    root, _, broken = saved
    (broken / "shard-00000.safetensors").write_bytes(b"torn")
    state = make_state(seed=3)
    with structlog.testing.capture_logs() as logs, CheckpointEngine(root) as eng:
        result = eng.save(2, {"app": state}, block=True)
    assert (result.skipped, layout.inspect_checkpoint(broken).consistent) == (False, True)
    assert (root / "step-000000002.corrupt" / "shard-00000.safetensors").read_bytes() == b"torn"  # evidence kept
    assert [e["log_level"] for e in logs if e["event"] == "checkpoint_quarantined"] == ["warning"]


def test_a_save_over_a_newer_format_step_fails_and_leaves_it_as_it_is(
    saved: tuple[Path, list[torch.Tensor], Path],
) -> None:
    root, _, newer = saved
    manifest = json.loads((newer / layout.MANIFEST_NAME).read_text())
    write_manifest_json(newer, dict(manifest, format_version=layout.FORMAT_VERSION + 1))
    before = sorted((p.name, p.stat().st_size) for p in newer.iterdir())
    with structlog.testing.capture_logs() as logs, CheckpointEngine(root) as eng:
        with pytest.raises(CheckpointSaveError, match="format this ftsup does not read"):
            eng.save(2, {"app": make_state()}, block=True)
        assert eng.save(3, {"app": make_state()}, block=True).step == 3  # the next save is not stopped by it
    assert sorted((p.name, p.stat().st_size) for p in newer.iterdir()) == before
    assert [e["step"] for e in logs if e["event"] == "checkpoint_save_failed"] == [2]


def test_a_save_over_a_symlink_named_like_its_step_fails_and_follows_nothing(
    saved: tuple[Path, list[torch.Tensor], Path], tmp_path: Path
) -> None:
    root, _, _ = saved
    victim = tmp_path / "victim"
    victim.mkdir()
    (root / layout.step_dirname(3)).symlink_to(victim)
    (root / layout.partial_dirname(4)).symlink_to(victim)
    with CheckpointEngine(root) as eng:
        with pytest.raises(CheckpointSaveError, match="is not a directory"):
            eng.save(3, {"app": make_state()}, block=True)
        with pytest.raises(CheckpointSaveError, match="cannot prepare"):
            eng.save(4, {"app": make_state()}, block=True)
    assert list(victim.iterdir()) == []
