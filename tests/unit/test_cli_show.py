"""`ftsup ckpt show` of a checkpoint's tensors and of a Hugging Face model directory, in-process and torch-free:
what the headers say, never a tensor's byte, and hostile files refused with exit 2 naming the file and the tensor."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import hublayout, layout, stheader
from ftsup.supervisor.cli.commands import main
from tests.helpers import make_fake_checkpoint
from tests.unit.test_cli import run
from tests.unit.test_hublayout import sharded
from tests.unit.test_stheader import rchar


def test_show_json_of_a_sharded_hub_directory_lists_files_tensors_index_and_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = sharded(tmp_path / "m")
    (root / "config.json").write_text('{"model_type": "gpt2", "n_embd": 4}')
    code, out, _ = run(capsys, "ckpt", "show", str(root), "--json")
    got = json.loads(out)
    assert (code, got["layout"], got["sharded"], got["index_metadata"], got["config"], got["tensor_bytes"]) == (
        0,
        "hub",
        True,
        {"total_size": 40},
        {"model_type": "gpt2", "n_embd": 4},
        40,
    )
    assert got["tensors"] == [
        {"name": "a", "dtype": "F32", "shape": [2, 3], "bytes": 24, "files": ["model-00001-of-00002.safetensors"]},
        {"name": "b", "dtype": "BF16", "shape": [4], "bytes": 8, "files": ["model-00001-of-00002.safetensors"]},
        {"name": "c", "dtype": "I64", "shape": [1], "bytes": 8, "files": ["model-00002-of-00002.safetensors"]},
    ]
    assert [(f["file"], f["tensors"]) for f in got["files"]] == [
        ("model-00001-of-00002.safetensors", 2),
        ("model-00002-of-00002.safetensors", 1),
    ]


def test_show_of_a_hub_directory_as_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = sharded(tmp_path / "m")
    code, out, _ = run(capsys, "ckpt", "show", str(root))
    lines = [line.split() for line in out.splitlines()]
    assert (code, ["a", "F32", "2x3", "24", "model-00001-of-00002.safetensors"] in lines) == (0, True)
    assert "config: none (config.json)" in out and "tensors: 3, 40 B" in out


def test_show_reads_headers_and_never_a_tensors_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "m"
    root.mkdir()
    n = 256 << 20  # a sparse file: reading its tensor would cost 256 MiB of reads
    path = root / hublayout.SINGLE_NAME
    path.write_bytes(stheader.encode([("w", "U8", [n], n)], {"format": "pt"}))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + n)
    assert main(["ckpt", "show", str(root), "--json"]) == 0  # a first run: whatever it imports is imported
    capsys.readouterr()
    before = rchar()
    code, out, _ = run(capsys, "ckpt", "show", str(root), "--json")
    assert (code, json.loads(out)["tensor_bytes"], rchar() - before < 1 << 20) == (0, n, True)


@pytest.mark.parametrize(
    ("break_it", "says"),
    [
        (
            lambda r: (r / "model-00002-of-00002.safetensors").unlink(),
            "names model-00002-of-00002.safetensors (for tensor 'c'), which is missing",
        ),
        (
            lambda r: (r / "model-00002-of-00002.safetensors").write_bytes(
                stheader.encode([("c", "F6_E9", [1], 1)], None) + b"\0"
            ),
            "model-00002-of-00002.safetensors: tensor 'c': dtype 'F6_E9' is not one safetensors has",
        ),
        (
            lambda r: (r / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 8),
            "model-00002-of-00002.safetensors: a safetensors header of 18446744073709551615 bytes, over",
        ),
    ],
    ids=["missing-shard", "dtype", "oversized-header"],
)
def test_show_of_a_hostile_hub_directory_is_exit_2_naming_the_file_and_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], break_it: object, says: str
) -> None:
    root = sharded(tmp_path / "m")
    break_it(root)  # type: ignore[operator]
    code, out, err = run(capsys, "ckpt", "show", str(root))
    assert (code, out, says in err, err.count("\n")) == (2, "", True, 1), err


def test_show_of_a_hub_directory_with_a_step_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "ckpt", "show", str(sharded(tmp_path / "m")), "--step", "3")
    assert (code, "--step does not apply" in err) == (2, True)


def engine_files() -> tuple[dict[str, bytes], dict[str, Any]]:
    """A checkpoint's files as the engine lays them out: one float32 [4, 4] tensor in two row chunks, one per
    rank's shard (their bytes are garbage: show never reads them), and its dcp_metadata.json."""
    shard = bytes(4096 + 32)
    crc = bytes(4 * math.ceil(len(shard) / layout.CHECKSUM_BLOCK_BYTES))
    meta = {
        "tensors": {
            "train.model.w": {
                "dtype": "float32",
                "size": [4, 4],
                "chunks": [{"offsets": [0, 0], "sizes": [2, 4]}, {"offsets": [2, 0], "sizes": [2, 4]}],
            }
        },
        "storage": [
            {
                "fqn": "train.model.w",
                "offsets": [r * 2, 0],
                "sizes": [2, 4],
                "file": f"shard-0000{r}.safetensors",
                "crc_file": f"shard-0000{r}.crc32",
                "byte_offset": 4096,
                "nbytes": 32,
            }
            for r in (0, 1)
        ],
        "skeleton": {"d": [["train", {"d": [["model", {"d": [["w", {"T": "train.model.w"}]]}]]}]]},
    }
    files = {f"shard-0000{r}.safetensors": shard for r in (0, 1)} | {f"shard-0000{r}.crc32": crc for r in (0, 1)}
    return files | {layout.DCP_META_NAME: json.dumps(meta).encode()}, meta


def test_show_json_of_an_engine_checkpoint_lists_its_tensors_and_the_shards_holding_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files, _ = engine_files()
    make_fake_checkpoint(tmp_path, 7, files, metadata={"step": 7, "config": {"n_layer": 2}})
    code, out, _ = run(capsys, "ckpt", "show", str(tmp_path), "--json")
    got = json.loads(out)
    row = {
        "name": "train.model.w",
        "dtype": "float32",
        "shape": [4, 4],
        "bytes": 64,
        "files": ["shard-00000.safetensors", "shard-00001.safetensors"],
    }
    assert (code, got["format"], got["config"], got["tensor_bytes"], got["tensors"]) == (
        0,
        "ftsup",
        {"n_layer": 2},
        64,
        [row],
    )


def test_show_of_a_checkpoint_whose_dcp_metadata_lies_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files, meta = engine_files()
    meta["storage"][1]["byte_offset"] = 4100  # type: ignore[index]  # its 32 bytes would run past the shard's end
    make_fake_checkpoint(tmp_path, 7, files | {layout.DCP_META_NAME: json.dumps(meta).encode()}, metadata={"step": 7})
    code, _, err = run(capsys, "ckpt", "show", str(tmp_path))
    assert (code, "dcp_metadata.json: storage[1].byte_offset 4100 + 32 bytes is not inside shard-00001" in err) == (
        2,
        True,
    ), err


def test_show_of_a_checkpoint_failing_the_fast_check_shows_it_without_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files, _ = engine_files()
    ckpt = make_fake_checkpoint(tmp_path, 7, files, metadata={"step": 7})
    (ckpt / "shard-00001.safetensors").write_bytes(b"short")
    code, out, _ = run(capsys, "ckpt", "show", str(tmp_path), "--json")
    got = json.loads(out)
    assert (code, got["consistent"], got["tensors"]) == (0, False, None)
