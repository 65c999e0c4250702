"""Safetensors headers: read from a file as hostile input (never a tensor's byte), and written as safetensors'
writer writes them.

Stdlib only (ftsup/store/DESIGN.md, Hugging Face files). Not here: which files make a model (`hublayout`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftsup.store import dtypes, safefile
from ftsup.store.errors import CheckpointCorruptError, CheckpointError, os_words

HEADER_MAX_BYTES = 100_000_000
"""safetensors' own limit on a header (MAX_HEADER_SIZE): a header past it is refused unread."""
_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 62
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_RANK = {name: i for i, name in enumerate(dtypes.SAFETENSORS_BITS)}  # the format's order of its dtypes


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: str  # the safetensors name (`F32`, `BF16`, ...)
    shape: tuple[int, ...]
    start: int  # the first byte of its data, from the start of the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """What a safetensors file's header says: its tensors (in header order) and its metadata."""

    what: str  # the file, as errors name it
    file_size: int
    data_start: int  # 8 + the header's length: the bytes `read` read
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None


def read(path: str | os.PathLike[str], what: str, *, error: type[CheckpointError] = CheckpointCorruptError) -> Header:
    """The header of the regular file `path` (no link, FIFO or device), read and checked as above;
    raises `error` naming `what` and the tensor. Reads the header's bytes only."""
    fd = safefile.open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise error(f"{what}: {size} bytes, too short for a safetensors file (an 8-byte header length first)")
        (n,) = struct.unpack("<Q", _pread(fd, 8, 0, what, error))
        _check_length(n, size, what, error)
        raw = _pread(fd, n, 8, what, error)
    finally:
        os.close(fd)
    return parse(raw, size, what, error=error)


def parse(raw: bytes, file_size: int, what: str, *, error: type[CheckpointError] = CheckpointCorruptError) -> Header:
    """The header whose JSON bytes are `raw` (the N bytes after the length) in a file of `file_size`."""
    _check_length(len(raw), file_size, what, error)
    if not raw.startswith(b"{"):
        raise error(f"{what}: the safetensors header does not start with '{{' (not a safetensors file?)")
    obj = safefile.loads(raw, f"{what}: header", max_values=len(raw) // 2 + 1, error=error, object_pairs_hook=_pairs)
    if not isinstance(obj, dict):
        raise error(f"{what}: the safetensors header is not a JSON object")
    data_start = 8 + len(raw)
    data_bytes = file_size - data_start
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise error(f"{what}: __metadata__ is not an object of strings")
    tensors: dict[str, TensorEntry] = {}
    for name, info in obj.items():
        tensors[name] = _entry(name, info, data_start, data_bytes, what, error)
    _check_tiling(tensors, data_start, file_size, what, error)
    return Header(what, file_size, data_start, tensors, metadata)


def encode(tensors: Sequence[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str] | None) -> bytes:
    """The first bytes of a safetensors file (length, header, padding) whose (name, safetensors dtype,
    shape, bytes) tensors follow in the given order, packed from the header's end."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    pos = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors' own writer does
    return struct.pack("<Q", len(raw)) + raw


def write_order(tensors: Sequence[tuple[str, str]]) -> list[int]:
    """The positions of (name, safetensors dtype) tensors in the order safetensors' writer lays their
    bytes out: by dtype, last of the format's list first (the widest: each tensor then starts naturally
    aligned), then by name."""
    return sorted(range(len(tensors)), key=lambda i: (-_RANK[tensors[i][1]], tensors[i][0]))


def nbytes_of(dtype: str, shape: Sequence[int]) -> int | None:
    """Bytes of a tensor of the safetensors `dtype` and `shape`; None when they are not whole."""
    bits = dtypes.SAFETENSORS_BITS[dtype]
    for d in shape:
        bits *= d
    return bits // 8 if bits % 8 == 0 else None


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r:.80} appears twice")
        out[k] = v
    return out


def _check_length(n: int, file_size: int, what: str, error: type[CheckpointError]) -> None:
    if n > HEADER_MAX_BYTES:
        raise error(f"{what}: a safetensors header of {n} bytes, over safetensors' limit of {HEADER_MAX_BYTES}")
    if 8 + n > file_size:
        raise error(f"{what}: the safetensors header ({n} bytes) runs past the end of the file ({file_size} bytes)")


def _entry(
    name: str, info: Any, data_start: int, data_bytes: int, what: str, error: type[CheckpointError]
) -> TensorEntry:
    where = f"{what}: tensor {name!r:.200}"
    if not isinstance(info, dict) or set(info) != _TENSOR_KEYS:
        raise error(f"{where}: not an object of exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in dtypes.SAFETENSORS_BITS:
        raise error(f"{where}: dtype {dtype!r:.40} is not one safetensors has")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
        raise error(f"{where}: shape {shape!r:.80} is not a list of at most {_MAX_DIMS} integers >= 0")
    elements = 1
    for d in shape:
        elements *= d
    if elements > _MAX_ELEMENTS:
        raise error(f"{where}: shape {shape!r:.80} is impossibly large")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise error(f"{where}: data_offsets {offsets!r:.80} is not [begin, end] of integers >= 0")
    begin, end = offsets
    if end < begin:
        raise error(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    want = nbytes_of(dtype, shape)
    if want is None:
        raise error(f"{where}: {elements} values of {dtype} are not a whole number of bytes")
    if end - begin != want:
        raise error(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes; {dtype} of shape {shape} takes {want}"
        )
    if end > data_bytes:
        raise error(f"{where}: its bytes [{begin}, {end}) run past the end of the file ({data_bytes} data bytes)")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_tiling(
    tensors: Mapping[str, TensorEntry], data_start: int, file_size: int, what: str, error: type[CheckpointError]
) -> None:
    pos, prev = data_start, None
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end, t.name)):
        if t.start < pos and prev is not None:  # prev: only a tensor before can be overlapped
            raise error(
                f"{what}: tensor {t.name!r:.200} overlaps tensor {prev.name!r:.200} (bytes "
                f"{t.start - data_start}..{pos - data_start})"
            )
        if t.start > pos:
            raise error(f"{what}: tensor {t.name!r:.200} leaves a hole of {t.start - pos} bytes before it")
        pos, prev = t.end, t
    if pos != file_size:
        raise error(
            f"{what}: {file_size - pos} bytes after the last tensor's end (the header accounts for "
            f"{pos - data_start} data bytes, the file has {file_size - data_start})"
        )


def _pread(fd: int, n: int, offset: int, what: str, error: type[CheckpointError]) -> bytes:
    chunks, pos = [], offset
    while pos < offset + n:
        try:
            got = os.pread(fd, min(offset + n - pos, 1 << 24), pos)
        except OSError as e:
            raise error(f"{what}: cannot read ({os_words(e)})") from None
        if not got:
            raise error(f"{what}: ends inside its safetensors header")
        chunks.append(got)
        pos += len(got)
    return b"".join(chunks)
