"""Where a DCP chunk's raw bytes are: each chunk is a torch.save archive (a zip) inside a data file; its central
directory, its `data.pkl` (read without running it) and its storage's local header are read by small ranged reads,
and the storage's bytes, stored as they are, lie in one range of the file. Stdlib only.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass

from ftsup.store import dcppickle, dtypes
from ftsup.store.errors import CheckpointError, ModelFileError

_MAX_READ = 4 << 20  # no read of an archive's structure is larger: a central directory of a few entries
_MAX_PICKLE = 1 << 20
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


@dataclass(frozen=True)
class ChunkBytes:
    """A chunk's tensor as torch.save stored it: its storage's bytes at `start` of the data file (absolute),
    `nbytes` of them, and the tensor's view of that storage (elements of `dtype`)."""

    start: int
    nbytes: int
    dtype: str
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        return self.stride == contiguous_strides(self.size)


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


class Window(io.RawIOBase):
    """The range [start, start + length) of a descriptor, as a seekable file of its own, read with `pread`;
    `read_bytes` counts what was read; a read of more than `max_read` bytes (None: any) is refused."""

    def __init__(self, fd: int, start: int, length: int, what: str, max_read: int | None = _MAX_READ) -> None:
        self.fd, self.start, self.length, self.what = fd, start, length, what
        self.max_read = max_read
        self.pos = 0
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        if self.max_read is not None and n > self.max_read:
            raise CheckpointError(f"{self.what}: an archive record of {n} bytes, more than such records take")
        data = os.pread(self.fd, n, self.start + self.pos) if n > 0 else b""
        self.pos += len(data)
        self.read_bytes += len(data)
        return data

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def locate(fd: int, offset: int, length: int, what: str) -> tuple[ChunkBytes, int]:
    """Where the tensor the archive at [`offset`, `offset` + `length`) of `fd` holds lies, and how many bytes of
    the archive's structure were read to find it. ModelFileError naming `what` for anything torch.save does not
    write, or a range past the archive's end."""
    window = Window(fd, offset, length, what)
    try:
        return _locate(window, what), window.read_bytes
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, KeyError, struct.error, OSError) as e:
        raise ModelFileError(f"{what}: not a torch.save archive ({type(e).__name__}: {e})") from None
    except CheckpointError as e:
        text = str(e)
        raise ModelFileError(text if text.startswith(what) else f"{what}: {text}") from None


def _locate(window: Window, what: str) -> ChunkBytes:
    with zipfile.ZipFile(window) as zf:  # reads the end records and the central directory only
        infos = {i.filename: i for i in zf.infolist()}
        pickles = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointError("no data.pkl (or more than one)")
        prefix = pickles[0][: -len("data.pkl")]
        pk = infos[pickles[0]]
        if pk.file_size > _MAX_PICKLE:
            raise CheckpointError(f"a data.pkl of {pk.file_size} bytes")
        record = dcppickle.load_tensor(zf.read(pk), f"{what} ({pickles[0]})")
    storage = record.storage
    if not (storage.key.isdigit() and len(storage.key) < 20):
        raise CheckpointError(f"a storage key {storage.key!r:.40}")
    info = infos.get(f"{prefix}data/{storage.key}")
    if info is None:
        raise CheckpointError(f"its tensor's storage {prefix}data/{storage.key} is missing")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError("its tensor's storage is compressed")
    dtype = record.dtype or ""  # `load_tensor` set it
    itemsize = dtypes.lookup(dtype, what).itemsize
    nbytes = storage.numel * (1 if not storage.dtype else itemsize)
    if storage.numel < 0 or info.file_size != nbytes:
        raise CheckpointError(f"its storage holds {info.file_size} bytes, its pickle says {nbytes}")
    size = _ints(record.size, "size")
    stride = _ints(record.stride, "stride")
    offset = record.offset
    if type(offset) is not int or offset < 0 or len(stride) != len(size):
        raise CheckpointError("a tensor view that torch.save does not write")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else offset - 1
    if (last + 1) * itemsize > nbytes:
        raise CheckpointError("its tensor reaches past the end of its storage")
    header = _read(window, info.header_offset)
    sig, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if sig != b"PK\x03\x04" or method != zipfile.ZIP_STORED:
        raise CheckpointError("its storage's local header is not a stored zip entry's")
    name = _read(window, info.header_offset + _LOCAL_HEADER.size, name_len)
    if name.decode("utf-8", "replace") != info.filename:
        raise CheckpointError("its storage's local header names another entry")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + nbytes > window.length:
        raise CheckpointError("its storage's bytes run past the archive's end")
    return ChunkBytes(window.start + start, nbytes, dtype, offset, size, stride)


def _read(window: Window, at: int, n: int = _LOCAL_HEADER.size) -> bytes:
    window.seek(at)
    data = window.read(n)
    if len(data) != n:
        raise CheckpointError("cut short inside its archive")
    return data


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > 64 or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(f"a tensor {what} that is not a tuple of integers")
    return value
