"""The Hub's layout (`ftsup.store.hublayout`): sizes and the shard split as huggingface_hub has them, and a
model directory read as hostile input, header by header."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from huggingface_hub.serialization._base import parse_size_to_int, split_state_dict_into_shards_factory

from ftsup.store import hublayout, stheader
from ftsup.store.errors import ModelFileError


@pytest.mark.parametrize("text", ["5GB", "500MB", "1KB", "2TB", "1.5GB", " 5 GB ", "5gB"])
def test_a_decimal_size_is_what_huggingface_hub_reads(text: str) -> None:
    assert hublayout.parse_size(text) == parse_size_to_int(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 << 30), ("1MiB", 1 << 20), ("3kib", 3 << 10), ("5000000000", 5 * 10**9), ("1TiB", 1 << 40)],
)
def test_binary_units_and_plain_bytes_are_what_transformers_reads(text: str, size: int) -> None:
    assert hublayout.parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("5Gb", "ambiguous"),
        ("5gb", "ambiguous"),
        ("7B", "units: KB"),
        ("5 GBs", "units: KB"),
        ("1.5", "an integer"),
        ("GB", "not a size"),
        ("-5GB", "not a size"),
        ("0GB", "at least 1 byte"),
        ("0.0000001KB", "at least 1 byte"),
    ],
)
def test_a_size_the_hubs_tools_would_read_otherwise_or_not_at_all_is_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        hublayout.parse_size(text)


def hub_split(sizes: list[tuple[str, int]], max_bytes: int) -> list[tuple[str, list[str]]]:
    split = split_state_dict_into_shards_factory(
        dict(sizes),
        get_storage_size=lambda n: n,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_bytes,
    )
    return list(split.filename_to_tensors.items())


@pytest.mark.parametrize("seed", range(20))
def test_the_shard_split_and_names_are_huggingface_hubs(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [(f"t{i}", rng.choice([0, 1, 7, 100, 999, 1000, 1001, 2500])) for i in range(rng.randint(1, 40))]
    max_bytes = rng.choice([1, 999, 1000, 3000])
    shards = hublayout.plan_shards(sizes, max_bytes)
    assert list(zip(hublayout.shard_names(len(shards)), shards, strict=True)) == hub_split(sizes, max_bytes)


def test_the_index_is_what_save_torch_state_dict_writes() -> None:
    got = json.loads(hublayout.index_bytes({"b": "model-00001-of-00002.safetensors", "a": "x"}, 12))
    assert (list(got), list(got["weight_map"]), got["metadata"]) == (
        ["metadata", "weight_map"],
        ["b", "a"],
        {"total_size": 12},
    )


# --------------------------------------------------------------------------- reading a directory


def write_st(path: Path, tensors: dict[str, tuple[str, list[int]]], fill: int = 0xAB) -> None:
    """A safetensors file of (dtype, shape) tensors whose data bytes are `fill` (garbage: never read)."""
    entries = [(n, d, s, stheader.nbytes_of(d, s) or 0) for n, (d, s) in tensors.items()]
    path.write_bytes(stheader.encode(entries, {"format": "pt"}) + bytes([fill]) * sum(e[3] for e in entries))


def sharded(root: Path) -> Path:
    root.mkdir()
    write_st(root / "model-00001-of-00002.safetensors", {"a": ("F32", [2, 3]), "b": ("BF16", [4])})
    write_st(root / "model-00002-of-00002.safetensors", {"c": ("I64", [1])})
    index = {
        "metadata": {"total_size": 40},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    (root / hublayout.INDEX_NAME).write_text(json.dumps(index))
    return root


def test_a_sharded_directory_reads_as_its_index_and_headers(tmp_path: Path) -> None:
    model = hublayout.read(sharded(tmp_path / "m"))
    got = {n: (e.dtype, e.shape, e.nbytes, model.weight_map[n]) for n, e in model.tensors.items()}
    assert (got, model.index) == (
        {
            "a": ("F32", (2, 3), 24, "model-00001-of-00002.safetensors"),
            "b": ("BF16", (4,), 8, "model-00001-of-00002.safetensors"),
            "c": ("I64", (1,), 8, "model-00002-of-00002.safetensors"),
        },
        {"total_size": 40},
    )


def test_a_single_file_directory_is_its_one_header(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    write_st(tmp_path / "m" / hublayout.SINGLE_NAME, {"w": ("F16", [2])})
    model = hublayout.read(tmp_path / "m")
    assert (model.index, model.weight_map) == (None, {"w": hublayout.SINGLE_NAME})


def read_error(root: Path) -> str:
    with pytest.raises(ModelFileError) as e:
        hublayout.read(root)
    return str(e.value)


def test_an_index_naming_a_missing_shard_names_the_index_the_file_and_a_tensor(tmp_path: Path) -> None:
    root = sharded(tmp_path / "m")
    (root / "model-00002-of-00002.safetensors").unlink()
    assert read_error(root) == (
        f"{root / hublayout.INDEX_NAME}: names model-00002-of-00002.safetensors (for tensor 'c'), which is missing"
    )


def test_an_index_putting_a_tensor_in_a_shard_without_it_is_refused(tmp_path: Path) -> None:
    root = sharded(tmp_path / "m")
    index = json.loads((root / hublayout.INDEX_NAME).read_text())
    index["weight_map"]["d"] = "model-00002-of-00002.safetensors"
    (root / hublayout.INDEX_NAME).write_text(json.dumps(index))
    assert "puts tensor 'd' in model-00002-of-00002.safetensors, whose header has no such tensor" in read_error(root)


def test_a_shard_holding_a_tensor_the_index_does_not_list_is_refused(tmp_path: Path) -> None:
    root = sharded(tmp_path / "m")
    write_st(root / "model-00002-of-00002.safetensors", {"c": ("I64", [1]), "extra": ("U8", [1])})
    assert "holds tensor 'extra', but model.safetensors.index.json does not list it" in read_error(root)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd.safetensors", "model.bin", ""])
def test_an_index_naming_a_file_outside_the_directory_or_not_safetensors_is_refused(tmp_path: Path, name: str) -> None:
    root = sharded(tmp_path / "m")
    index = json.loads((root / hublayout.INDEX_NAME).read_text())
    index["weight_map"]["c"] = name
    (root / hublayout.INDEX_NAME).write_text(json.dumps(index))
    assert "which is not a relative path of a .safetensors file inside the directory" in read_error(root)


def test_a_bad_shard_header_names_the_shard_and_the_tensor(tmp_path: Path) -> None:
    root = sharded(tmp_path / "m")
    path = root / "model-00002-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-1])  # its one tensor now runs past the end
    assert read_error(root).startswith(f"{path}: tensor 'c': its bytes [0, 8) run past the end of the file")


def test_an_index_that_is_not_an_object_with_a_weight_map_is_refused(tmp_path: Path) -> None:
    root = sharded(tmp_path / "m")
    (root / hublayout.INDEX_NAME).write_text('{"metadata": {}}')
    assert "not a JSON object with a weight_map object" in read_error(root)


def test_a_directory_without_weights_says_so(tmp_path: Path) -> None:
    assert "holds neither model.safetensors nor model.safetensors.index.json" in read_error(tmp_path)


def test_links_are_followed_in_a_callers_directory_and_refused_in_a_store(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    write_st(tmp_path / "blobs" / "abc", {"w": ("F32", [1])})
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / hublayout.SINGLE_NAME).symlink_to(tmp_path / "blobs" / "abc")  # as the Hub's cache does
    followed = hublayout.read(tmp_path / "snap").weight_map
    with pytest.raises(ModelFileError, match="is a symbolic link"):
        hublayout.read(tmp_path / "snap", follow_links=False)
    assert followed == {"w": hublayout.SINGLE_NAME}
