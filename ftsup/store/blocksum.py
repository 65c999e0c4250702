"""Block checksums: a CRC per 64 KiB block and a file checksum over the blocks' checksums, stdlib only.

``crc32cx64k`` (CRC-32C, the C extension `_blocksum` or a pure-Python fallback) is written, ``crc32x64k`` (zlib)
still verified; `StreamingBlocks` fuses them into a copy (ftsup/store/DESIGN.md, File format).
"""

from __future__ import annotations

import array
import struct
import zlib
from collections.abc import Callable
from types import ModuleType

BLOCK_BYTES = 64 * 1024
CRC32C_X64K = "crc32cx64k"
CRC32_X64K = "crc32x64k"
CURRENT = CRC32C_X64K
"""The algorithm new checkpoints are written with."""
ALGORITHMS = (CRC32C_X64K, CRC32_X64K)
"""Every algorithm this version verifies."""

Data = bytes | bytearray | memoryview


def _load_extension() -> ModuleType | None:
    try:
        from ftsup.store import _blocksum
    except ImportError:  # not built: the pure-Python path below gives the same answers
        return None
    return _blocksum


_ext = _load_extension()


def extension() -> ModuleType | None:
    """The C extension, or None when it is not built."""
    return _ext


def implementation() -> str:
    """What computes CRC-32C here: "sse4.2" or "software" (the C extension), or "python"."""
    return _ext.implementation() if _ext is not None else "python"


# --------------------------------------------------------------------------- pure-Python CRC-32C

_POLY = 0x82F63B78  # Castagnoli, bit-reflected


def _tables() -> tuple[tuple[int, ...], ...]:
    """Slicing-by-8 tables: entry [k][n] is the CRC register after byte n and k zero bytes."""
    first = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        first.append(c)
    tables = [tuple(first)]
    for _ in range(7):
        tables.append(tuple(first[c & 0xFF] ^ (c >> 8) for c in tables[-1]))
    return tuple(tables)


_T = _tables()


def crc32c_python(data: Data, crc: int = 0) -> int:
    """CRC-32C of `data` continuing from `crc` (like zlib.crc32), in pure Python.

    The reference the C extension is tested against, and the fallback where it is not built:
    correct, but far slower, and it holds the GIL.
    """
    t0, t1, t2, t3, t4, t5, t6, t7 = _T
    mv = memoryview(data).cast("B")
    c = crc ^ 0xFFFFFFFF
    n8 = len(mv) // 8 * 8
    for lo, hi in struct.iter_unpack("<II", mv[:n8]):
        lo ^= c
        low = t7[lo & 0xFF] ^ t6[(lo >> 8) & 0xFF] ^ t5[(lo >> 16) & 0xFF] ^ t4[lo >> 24]
        high = t3[hi & 0xFF] ^ t2[(hi >> 8) & 0xFF] ^ t1[(hi >> 16) & 0xFF] ^ t0[hi >> 24]
        c = low ^ high
    for b in mv[n8:]:
        c = t0[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def crc32c(data: Data, crc: int = 0) -> int:
    """CRC-32C of `data` continuing from `crc`, with the fastest implementation available."""
    if _ext is not None:
        return _ext.crc32c(data, crc)
    return crc32c_python(data, crc)


# --------------------------------------------------------------------------- blocks


def _crc32c_blocks(mv: memoryview) -> list[int]:
    if _ext is not None:
        raw = _ext.crc32c_blocks(mv, BLOCK_BYTES)
        return list(struct.unpack(f"<{len(raw) // 4}I", raw))
    return [crc32c_python(mv[off : off + BLOCK_BYTES]) for off in range(0, len(mv), BLOCK_BYTES)]


def _crc32_blocks(mv: memoryview) -> list[int]:
    return [zlib.crc32(mv[off : off + BLOCK_BYTES]) for off in range(0, len(mv), BLOCK_BYTES)]


_BLOCKS: dict[str, Callable[[memoryview], list[int]]] = {CRC32C_X64K: _crc32c_blocks, CRC32_X64K: _crc32_blocks}
_COMBINE: dict[str, Callable[[bytes], int]] = {CRC32C_X64K: crc32c, CRC32_X64K: zlib.crc32}


def require_known(algorithm: str) -> str:
    """`algorithm`, or ValueError naming the ones this version knows."""
    if algorithm not in _BLOCKS:
        raise ValueError(f"checksum algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return algorithm


def block_checksums(data: Data, algorithm: str = CURRENT) -> list[int]:
    """The checksum of each 64 KiB block of `data` (the last block may be short)."""
    return _BLOCKS[require_known(algorithm)](memoryview(data).cast("B"))


def pack(sums: list[int]) -> bytes:
    """Block checksums as stored in the `.crc32` sidecar file: little-endian uint32 each."""
    return struct.pack(f"<{len(sums)}I", *sums)


def file_checksum_of_blocks(sums: list[int], algorithm: str = CURRENT) -> int:
    """The file checksum: the algorithm's CRC over the packed block checksums."""
    return _COMBINE[require_known(algorithm)](pack(sums))


# --------------------------------------------------------------------------- streaming


def fused_copy_available() -> bool:
    """Whether `StreamingBlocks.copy` runs in hardware: copying with it then costs less than a
    plain copy followed by a checksum pass. Elsewhere callers should copy as before and
    checksum later, off their critical path."""
    return implementation() == "sse4.2"


class StreamingBlocks:
    """CRC-32C block checksums of a `total`-byte file assembled in order, piece by piece.

    Each piece is either checksummed where it lies (`update`) or copied into place and
    checksummed in the same pass (`copy`). Pieces must come in file order without gaps or
    overlaps; `finish()` returns the same list as `block_checksums` of the assembled file.
    """

    def __init__(self, total: int) -> None:
        if _ext is None:
            raise RuntimeError("StreamingBlocks needs the C extension ftsup.store._blocksum")
        self.total = total
        self._pos = 0
        self._regs = array.array("I", bytes(4 * -(-total // BLOCK_BYTES)))

    def _advance(self, offset: int, n: int) -> None:
        if offset != self._pos:
            raise ValueError(f"pieces must come in file order: expected offset {self._pos}, got {offset}")
        if offset + n > self.total:
            raise ValueError(f"a piece ends at byte {offset + n}, past the file's {self.total} bytes")
        self._pos += n

    def update(self, data: Data, offset: int) -> None:
        """`data` holds the file's bytes from `offset` on."""
        mv = memoryview(data).cast("B")
        self._advance(offset, len(mv))
        assert _ext is not None
        _ext.blocks_update(mv, offset, self._regs, BLOCK_BYTES)

    def copy(self, dst: memoryview, src: Data, offset: int) -> None:
        """Copy `src` into `dst` (the same size): the file's bytes from `offset` on."""
        mv = memoryview(src).cast("B")
        self._advance(offset, len(mv))
        assert _ext is not None
        _ext.copy_blocks_update(dst, mv, offset, self._regs, BLOCK_BYTES)

    def finish(self) -> list[int]:
        """The block checksums, once every byte has been seen."""
        if self._pos != self.total:
            raise ValueError(f"{self.total - self._pos} bytes of the file were never seen (from byte {self._pos})")
        return [r ^ 0xFFFFFFFF for r in self._regs]
