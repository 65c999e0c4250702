"""`ftsup ckpt verify` applies the loader's checks of `dcp_metadata.json` (`dcpmeta`, one definition): a checkpoint
whose metadata points outside its shard, its checksums recomputed, is inconsistent to both (ftsup/store/DESIGN.md,
"A hostile store")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ftsup.store import checksums, layout
from ftsup.store.errors import NoCheckpointError
from ftsup.supervisor.cli import main
from ftsup.trainer.checkpoint import CheckpointEngine

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "checkpoint-format1"
STEP_DIR = "step-000000007"


def forged(tmp_path: Path, byte_offset: int) -> Path:
    """The format-1 fixture with its first chunk's byte offset set to `byte_offset`, the manifest's size and
    checksum of `dcp_metadata.json` recomputed to match: every file verifies."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    ckpt = root / STEP_DIR
    meta = json.loads((ckpt / layout.DCP_META_NAME).read_bytes())
    meta["storage"][0]["byte_offset"] = byte_offset
    raw = json.dumps(meta).encode()
    (ckpt / layout.DCP_META_NAME).write_bytes(raw)
    manifest = json.loads((ckpt / layout.MANIFEST_NAME).read_bytes())
    manifest["files"][layout.DCP_META_NAME] = {"size": len(raw), "checksum": checksums.checksum_bytes(raw)}
    (ckpt / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
    return root


def verify(capsys: pytest.CaptureFixture[str], root: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    code = main(["ckpt", "verify", str(root), "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("deep", [False, True], ids=["fast", "deep"])
def test_verify_passes_the_format_1_fixture_with_its_dcp_metadata_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], deep: bool
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    code, report = verify(capsys, root, *(["--deep"] if deep else []))
    assert (code, report["consistent"], report["problems"]) == (0, True, [])


@pytest.mark.parametrize("deep", [False, True], ids=["fast", "deep"])
@pytest.mark.parametrize("byte_offset", [-4096, 10**12])
def test_verify_and_the_loader_both_refuse_dcp_metadata_pointing_outside_its_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], byte_offset: int, deep: bool
) -> None:
    root = forged(tmp_path, byte_offset)
    code, report = verify(capsys, root, *(["--deep"] if deep else []))
    problems = report["problems"]
    assert (code, report["consistent"], [p["file"] for p in problems]) == (1, False, [layout.DCP_META_NAME])
    assert (
        f"storage[0].byte_offset {byte_offset} + 40 bytes is not inside shard-00000.safetensors"
        in (problems[0]["reason"])
    )
    state = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64), "h": torch.zeros(2, 2)}}
    state["model"]["h"] = state["model"]["h"].to(torch.bfloat16)
    with CheckpointEngine(root, o_direct=False, recycle=False, durable_tier=None) as engine:
        with pytest.raises(NoCheckpointError) as refused:
            engine.load({**state, "extra": {}})
    assert "byte_offset" in " ".join(refused.value.rejected)
