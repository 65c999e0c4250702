"""Recorded checksums (``crc32cx64k:1a2b3c4d``) of bytes, files and block lists, and the `.crc32` sidecar format.

Not here: the algorithms (`blocksum`), where files live and what a manifest holds (`layout`).
"""

from __future__ import annotations

import io
import os
import re
import struct

from ftsup.store import blocksum, safefile
from ftsup.store.errors import CheckpointCorruptError, ManifestError

_READ_CHUNK = 16 * 1024 * 1024


def block_crcs(
    data: bytes | bytearray | memoryview,
    start_crcs: list[int] | None = None,
    algorithm: str = blocksum.CURRENT,
) -> list[int]:
    """Checksum of each 64 KiB block of `data` (the last block may be short), appended to
    `start_crcs` when given."""
    sums = blocksum.block_checksums(data, algorithm)
    if start_crcs is None:
        return sums
    start_crcs.extend(sums)
    return start_crcs


def pack_block_crcs(crcs: list[int]) -> bytes:
    return blocksum.pack(crcs)


def unpack_block_crcs(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise CheckpointCorruptError("block checksum list has a torn entry")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def checksum_from_block_crcs(crcs: list[int], algorithm: str = blocksum.CURRENT) -> str:
    return f"{algorithm}:{blocksum.file_checksum_of_blocks(crcs, algorithm):08x}"


def checksum_bytes(data: bytes | bytearray | memoryview, algorithm: str = blocksum.CURRENT) -> str:
    return checksum_from_block_crcs(block_crcs(data, algorithm=algorithm), algorithm)


def checksum_algorithm(checksum: str) -> str:
    """The algorithm a recorded checksum names (``crc32cx64k:1a2b3c4d`` -> ``crc32cx64k``)."""
    algorithm, _, digits = checksum.partition(":")
    if algorithm not in blocksum.ALGORITHMS or not re.fullmatch(r"[0-9a-f]{8}", digits):
        raise ManifestError(
            f"checksum {checksum!r} is not '<algorithm>:<8 hex digits>' with an algorithm this ftsup "
            f"knows ({', '.join(blocksum.ALGORITHMS)}); upgrade ftsup to read it"
        )
    return algorithm


def checksum_matches(data: bytes | bytearray | memoryview, recorded: str) -> bool:
    """Whether `data` has the checksum `recorded`, computed with the algorithm it names."""
    return checksum_bytes(data, checksum_algorithm(recorded)) == recorded


def file_block_crcs(path: str | os.PathLike[str], algorithm: str = blocksum.CURRENT) -> list[int]:
    """Block checksums of the regular file `path` (a FIFO, device or symlink is refused: it must
    not block this or feed it for ever)."""
    fd = safefile.open_regular(path, str(path))
    with open(fd, "rb", buffering=0) as f:
        return stream_block_crcs(f, algorithm)


def stream_block_crcs(f: io.RawIOBase, algorithm: str = blocksum.CURRENT) -> list[int]:
    """Block checksums of everything `f` reads, however its reads are split."""
    crcs: list[int] = []
    buf = bytearray(_READ_CHUNK)  # a multiple of the block size
    view = memoryview(buf)
    while True:
        # One read may return less than asked (network filesystems); fill the whole buffer
        # first, or block boundaries would drift and checksums mismatch.
        n = 0
        while n < len(buf):
            got = f.readinto(view[n:])
            if not got:
                break
            n += got
        block_crcs(view[:n], crcs, algorithm)
        if n < len(buf):
            return crcs


def file_checksum(path: str | os.PathLike[str], algorithm: str = blocksum.CURRENT) -> str:
    return checksum_from_block_crcs(file_block_crcs(path, algorithm), algorithm)
