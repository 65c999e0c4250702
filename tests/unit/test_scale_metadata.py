"""What the costs at thousands of ranks called for (docs/benchmarks.md, at scale): the save plan's DCP metadata
encoded once per plan, and a resume choice that parses the chosen manifest once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ftsup.store import layout
from ftsup.supervisor.state.ckptstore import StoreScanner
from ftsup.trainer.checkpoint import staging
from ftsup.trainer.checkpoint.comm import LocalComm

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "checkpoint-format1"


def _flat() -> dict[str, torch.Tensor]:
    return {"a.w": torch.ones(3, 2), "a.b": torch.zeros(5, dtype=torch.bfloat16), "n": torch.tensor(4)}


def test_a_plan_s_metadata_is_the_encoding_of_the_whole_object_with_the_save_s_skeleton() -> None:
    flat = _flat()
    plan = staging.make_plan(flat, staging.signature(flat), LocalComm())
    planner, local = staging.plan_local(flat, True)
    per_rank, md = planner.create_global_plan([local])
    whole = staging._metadata_to_json(md, [staging._plan_chunks(p) for p in per_rank])
    skeleton: Any = {"d": [["a", {"T": "a.w"}], ["step", {"v": 12}]]}
    expected = json.dumps(dict(whole, skeleton=skeleton), separators=(",", ":")).encode()
    assert staging.metadata_bytes(plan, skeleton) == expected


def test_a_plan_keeps_its_metadata_encoded_not_as_objects() -> None:
    flat = _flat()
    plan = staging.make_plan(flat, staging.signature(flat), LocalComm())
    assert isinstance(plan.meta_head, bytes) and not hasattr(plan, "meta_json")


def test_the_resume_choice_parses_the_chosen_manifest_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)
    parsed: list[str] = []
    real = layout.parse_manifest

    def counted(raw: bytes | str, where: str = "manifest.json") -> layout.Manifest:
        parsed.append(where)
        return real(raw, where)

    monkeypatch.setattr(layout, "parse_manifest", counted)
    resume = StoreScanner(root).choose(timeout_s=60.0)
    assert resume.picked.info is not None and resume.picked.info.step == 7
    assert resume.metadata == {"step": 7, "note": "format 1 fixture"}
    assert len(parsed) == 1, parsed


def _manifest(ranks: int) -> layout.Manifest:
    files = {layout.shard_name(r): layout.FileEntry(r, f"{layout.CHECKSUM_ALGORITHM}:{r:08x}") for r in range(ranks)}
    return layout.Manifest(step=3, world_size=ranks, kind="periodic", created_unix=1.5, files=files, tensor_bytes=0)


def test_a_small_manifest_is_written_indented_and_reads_back_the_same() -> None:
    raw = layout.manifest_bytes(_manifest(8))
    assert raw.count(b"\n") > 8 and layout.parse_manifest(raw).to_json() == _manifest(8).to_json()


def test_a_manifest_of_thousands_of_files_is_written_compact_and_reads_back_the_same() -> None:
    many = layout.INDENTED_MANIFEST_FILES + 1
    raw = layout.manifest_bytes(_manifest(many))
    assert b"\n" not in raw and layout.parse_manifest(raw).to_json() == _manifest(many).to_json()
