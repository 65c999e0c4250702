"""Safetensors headers read as hostile input (`ftsup.store.stheader`): what safetensors accepts is
accepted, the rest refused naming the file and the tensor, and nothing but the header is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ftsup.store import dtypes, stheader
from ftsup.store.errors import CheckpointError, ModelFileError


def raw_file(path: Path, header: object, data: bytes, *, length: int | None = None) -> Path:
    """A file of the 8-byte length, `header` as JSON (a dict) or bytes as they are, then `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def read_error(path: Path) -> str:
    with pytest.raises(ModelFileError) as e:
        stheader.read(path, path.name, error=ModelFileError)
    return str(e.value)


def test_a_valid_header_gives_each_tensor_its_dtype_shape_and_absolute_byte_range(tmp_path: Path) -> None:
    head = {"__metadata__": {"format": "pt"}, "a": entry("F32", [2, 2], 0, 16), "b": entry("BF16", [3], 16, 22)}
    path = raw_file(tmp_path / "m.safetensors", head, bytes(22))
    got = stheader.read(path, "m")
    start = 8 + len(json.dumps(head))
    assert (got.metadata, got.data_start, got.tensors["b"]) == (
        {"format": "pt"},
        start,
        stheader.TensorEntry("b", "BF16", (3,), start + 16, start + 22),
    )


def test_encode_writes_a_header_that_read_accepts_with_data_8_byte_aligned(tmp_path: Path) -> None:
    head = stheader.encode([("w", "F16", [3], 6), ("i", "I8", [1], 1)], {"format": "pt"})
    path = tmp_path / "x.safetensors"
    path.write_bytes(head + bytes(7))
    got = stheader.read(path, "x")
    assert (len(head) % 8, got.tensors["w"].nbytes, got.tensors["i"].start - got.data_start) == (0, 6, 6)


def test_the_write_order_is_safetensors_by_dtype_then_name(tmp_path: Path) -> None:
    names = [("b", "BF16"), ("a", "U8"), ("c", "F64"), ("a2", "F16"), ("f4", "F4"), ("z", "F32"), ("y", "I32")]
    assert [names[i][0] for i in stheader.write_order(names)] == ["c", "z", "y", "b", "a2", "a", "f4"]


@pytest.mark.parametrize(
    ("header", "data", "says"),
    [
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12), "tensor 'b' overlaps tensor 'a'"),
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 12, 16)}, bytes(16), "tensor 'b' leaves a hole"),
        ({"a": entry("F32", [4], 0, 16)}, bytes(8), "tensor 'a': its bytes [0, 16) run past the end of the file"),
        ({"a": entry("F32", [2], 0, 8)}, bytes(12), "4 bytes after the last tensor's end"),
        ({"a": entry("F6_E9", [2], 0, 2)}, bytes(2), "tensor 'a': dtype 'F6_E9' is not one safetensors has"),
        ({"a": entry("F32", [3], 0, 8)}, bytes(8), "tensor 'a': data_offsets [0, 8] hold 8 bytes; F32 of shape [3]"),
        ({"a": entry("F4", [3], 0, 1)}, bytes(1), "tensor 'a': 3 values of F4 are not a whole number of bytes"),
        ({"a": entry("F32", [-1], 0, 0)}, b"", "tensor 'a': shape [-1] is not a list"),
        ({"a": {"dtype": "F32", "shape": [1]}}, bytes(4), "tensor 'a': not an object of exactly dtype, shape and"),
        ({"a": entry("U8", [1], 1, 0)}, bytes(1), "tensor 'a': data_offsets [1, 0] end before they begin"),
        ({"__metadata__": {"n": 1}}, b"", "__metadata__ is not an object of strings"),
        (b'{"a": {}, "a": {}}', b"", "the key 'a' appears twice"),
        (b' {"a": 1}', b"", "does not start with '{'"),
        (b"[1, 2]", b"", "does not start with '{'"),
        (b"{" * 200 + b"}" * 200, b"", "nested deeper"),
    ],
    ids=[
        "overlap",
        "hole",
        "past-end",
        "trailing-bytes",
        "dtype",
        "size",
        "sub-byte",
        "negative-dim",
        "keys",
        "backwards",
        "metadata",
        "duplicate",
        "start",
        "array",
        "depth",
    ],
)
def test_a_bad_header_is_refused_naming_the_file_and_the_tensor(
    tmp_path: Path, header: object, data: bytes, says: str
) -> None:
    path = raw_file(tmp_path / "bad.safetensors", header, data)
    message = read_error(path)
    assert (message.startswith("bad.safetensors: "), says in message) == (True, True), message


def test_a_header_length_past_safetensors_limit_is_refused_unread(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "big.safetensors", b"{}", b"", length=stheader.HEADER_MAX_BYTES + 1)
    assert "over safetensors' limit of 100000000" in read_error(path)


def test_a_header_length_past_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "short.safetensors", b"{}", b"", length=1000)
    assert "runs past the end of the file (10 bytes)" in read_error(path)


def test_a_file_shorter_than_the_length_field_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    assert "too short for a safetensors file" in read_error(tmp_path / "tiny.safetensors")


def test_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    real = raw_file(tmp_path / "real.safetensors", {}, b"")
    (tmp_path / "link.safetensors").symlink_to(real)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        stheader.read(tmp_path / "link.safetensors", "link.safetensors")


def rchar() -> int:
    """Bytes this process has read through read(2) and friends so far (Linux's /proc/self/io)."""
    line = next(x for x in Path("/proc/self/io").read_text().splitlines() if x.startswith("rchar:"))
    return int(line.split()[1])


def test_reading_a_header_reads_the_header_and_no_tensor_byte(tmp_path: Path) -> None:
    n = 256 << 20  # a sparse file: its hole costs no disk, but reading it would cost rchar
    path = raw_file(tmp_path / "big.safetensors", {"w": entry("U8", [n], 0, n)}, b"")
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + n)
    before = rchar()
    header = stheader.read(path, "big")
    assert (header.tensors["w"].nbytes, rchar() - before < 64 << 10) == (n, True)


def test_every_checkpoint_dtype_with_a_safetensors_name_is_one_the_format_has() -> None:
    assert {d.safetensors for d in dtypes.CHECKPOINT} - {None} <= set(dtypes.SAFETENSORS_BITS)
