"""The engine and its checksums: new checkpoints use CRC-32C, older CRC-32 ones still load and
still catch corruption, and an engine without the C extension works and says it is slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftsup.store import blocksum, checksums, layout
from ftsup.trainer.checkpoint import CheckpointEngine, NoCheckpointError, RetentionPolicy
from ftsup.trainer.hf.export import export_hf
from tests.helpers import flip_byte

REPO = Path(__file__).resolve().parents[2]


def save_one(root: Path, step: int, value: float) -> Path:
    with CheckpointEngine(root, retention=RetentionPolicy(keep_last=5)) as engine:
        engine.save(step, {"w": torch.full((70_000,), value)}, rank_state={"r": step}, block=True)
    return root / layout.step_dirname(step)


def rewrite_as_crc32x64k(ckpt: Path) -> None:
    """Turn a checkpoint into what an earlier ftsup wrote: same files, zlib CRC-32 checksums."""
    manifest = json.loads((ckpt / layout.MANIFEST_NAME).read_text())
    old = blocksum.CRC32_X64K
    for shard in ckpt.glob("*.safetensors"):
        crcs = checksums.file_block_crcs(shard, old)
        shard.with_suffix(".crc32").write_bytes(checksums.pack_block_crcs(crcs))
        manifest["files"][shard.name]["checksum"] = checksums.checksum_from_block_crcs(crcs, old)
    for rel in manifest["files"]:
        if not rel.endswith(".safetensors"):
            manifest["files"][rel]["checksum"] = checksums.file_checksum(ckpt / rel, old)
    manifest["checksum_algorithm"] = old
    (ckpt / layout.MANIFEST_NAME).write_text(json.dumps(manifest))


def test_new_checkpoints_record_crc32c_everywhere(tmp_path: Path) -> None:
    ckpt = save_one(tmp_path, 1, 1.0)
    manifest = layout.read_manifest(ckpt)
    algorithms = {e.checksum.split(":")[0] for e in manifest.files.values()}
    assert (manifest.checksum_algorithm, algorithms, layout.check_checkpoint(ckpt, deep=True)[1]) == (
        "crc32cx64k",
        {"crc32cx64k"},
        [],
    )


def test_a_crc32x64k_checkpoint_of_an_earlier_version_verifies_and_loads(tmp_path: Path) -> None:
    ckpt = save_one(tmp_path, 1, 3.0)
    rewrite_as_crc32x64k(ckpt)
    state = {"w": torch.zeros(70_000)}
    with CheckpointEngine(tmp_path) as engine:
        loaded = engine.load(state)
    assert (
        layout.check_checkpoint(ckpt, deep=True)[1],
        loaded.rank_state,
        torch.equal(state["w"], torch.full((70_000,), 3.0)),
    ) == ([], {"r": 1}, True)


def test_a_crc32x64k_checkpoint_of_an_earlier_version_exports_to_hugging_face(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        engine.save(1, {"app": {"model": model.state_dict()}}, block=True)
    rewrite_as_crc32x64k(tmp_path / "ckpt" / layout.step_dirname(1))
    index = export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    assert sorted(index["weight_map"]) == ["bias", "weight"]


def test_a_flipped_byte_in_a_crc32x64k_checkpoint_is_still_caught(tmp_path: Path) -> None:
    ckpt = save_one(tmp_path, 1, 3.0)
    rewrite_as_crc32x64k(ckpt)
    flip_byte(ckpt / "shard-00000.safetensors", 4096 + 100_000)
    _, problems = layout.check_checkpoint(ckpt, deep=True)
    with CheckpointEngine(tmp_path) as engine, pytest.raises(NoCheckpointError):
        engine.load({"w": torch.zeros(70_000)})
    assert [p.file for p in problems] == ["shard-00000.safetensors"]


def test_without_the_extension_the_engine_saves_loads_and_warns_once(tmp_path: Path) -> None:
    probe = f"""
import json, sys
sys.modules["ftsup.store._blocksum"] = None  # a source checkout that was never built
import torch
from structlog.testing import capture_logs
from ftsup.trainer.checkpoint import CheckpointEngine
from ftsup.store import blocksum
with capture_logs() as logs:
    with CheckpointEngine({str(tmp_path)!r}) as engine:
        engine.save(1, {{"w": torch.arange(70_000, dtype=torch.float32)}}, block=True)
    state = {{"w": torch.zeros(70_000)}}
    with CheckpointEngine({str(tmp_path)!r}) as engine:
        engine.load(state)
print(json.dumps({{"impl": blocksum.implementation(), "equal": bool(torch.equal(state["w"], torch.arange(70_000.0))),
                  "warnings": [e["event"] for e in logs if e["log_level"] == "warning"]}}))
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "impl": "python",
        "equal": True,
        "warnings": ["checkpoint_checksums_slow"],
    }
    assert layout.check_checkpoint(tmp_path / layout.step_dirname(1), deep=True)[1] == []
