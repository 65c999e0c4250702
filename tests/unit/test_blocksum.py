"""Block checksums: CRC-32C from the C extension (hardware and portable paths) and from pure
Python agree with each other and with the published check values; the older zlib algorithm
still verifies."""

from __future__ import annotations

import array
import ctypes
import json
import os
import random
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from ftsup.store import blocksum, checksums

REPO = Path(__file__).resolve().parents[2]
BLOCK = blocksum.BLOCK_BYTES
EXT = blocksum.extension()

Crc = Callable[[bytes], int]


@pytest.fixture
def ext() -> ModuleType:
    """The C extension; tests that need it are skipped, saying so, where it is not built."""
    if EXT is None:
        pytest.skip("the C extension ftsup.store._blocksum is not built")
    return EXT


def _implementations() -> dict[str, Crc]:
    impls: dict[str, Crc] = {"python": blocksum.crc32c_python}
    if EXT is not None:
        c_ext = EXT
        impls["c-best"] = c_ext.crc32c
        impls["c-software"] = lambda data: c_ext.crc32c(data, software=True)
    return impls


IMPLS = _implementations()

# RFC 3720 (iSCSI) appendix B.4, and the "123456789" check value of the CRC catalogue.
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(("data", "expected"), VECTORS, ids=[f"vector{i}" for i in range(len(VECTORS))])
def test_crc32c_matches_the_published_check_values(impl: str, data: bytes, expected: int) -> None:
    assert IMPLS[impl](data) == expected


def test_the_c_extension_uses_the_crc32c_instruction_where_the_cpu_has_one(ext: ModuleType) -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = "sse4.2" if " sse4_2" in flags and os.uname().machine == "x86_64" else "software"
    assert (ext.implementation(), blocksum.implementation()) == (expected, expected)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_crc32c_continues_from_a_previous_value_like_zlib(impl: str) -> None:
    data = random.Random(1).randbytes(1000)
    crc = IMPLS[impl]
    assert blocksum.crc32c(data[600:], crc(data[:600])) == crc(data)


def test_c_and_python_agree_on_every_length_and_alignment(ext: ModuleType) -> None:
    data = random.Random(2).randbytes(3 * 4096 + 64)
    cases = [(start, n) for start in range(9) for n in (*range(0, 40), 4095, 4096, 4097, 3 * 4096 + 7)]
    for start, n in cases:
        piece = memoryview(data)[start : start + n]
        expected = blocksum.crc32c_python(piece)
        assert (ext.crc32c(piece), ext.crc32c(piece, software=True)) == (expected, expected), (start, n)


@pytest.mark.parametrize("nblocks_and_tail", [(0, 0), (0, 5), (1, 0), (2, 1), (3, 0), (4, 4097), (7, 3)])
def test_c_block_checksums_are_crc32c_of_each_block_on_both_paths(
    ext: ModuleType, nblocks_and_tail: tuple[int, int]
) -> None:
    nblocks, tail = nblocks_and_tail
    data = random.Random(3).randbytes(nblocks * BLOCK + tail)
    expected = [blocksum.crc32c_python(data[off : off + BLOCK]) for off in range(0, len(data), BLOCK)]
    packed = blocksum.pack(expected)
    assert (ext.crc32c_blocks(data), ext.crc32c_blocks(data, software=True)) == (packed, packed)


def test_c_block_checksums_take_any_block_size_and_unaligned_buffers(ext: ModuleType) -> None:
    data = random.Random(4).randbytes(10_000)
    view = memoryview(data)[3:]
    expected = [blocksum.crc32c_python(view[off : off + 1000]) for off in range(0, len(view), 1000)]
    assert ext.crc32c_blocks(view, 1000) == blocksum.pack(expected)


@pytest.mark.parametrize(
    ("function", "args", "message"),
    [
        ("crc32c_blocks", (b"abc", 0), "block_bytes must be positive"),
        ("crc32c", (b"abc", -1), "unsigned 32-bit"),
        ("crc32c", (b"abc", 2**32), "unsigned 32-bit"),
    ],
)
def test_c_extension_refuses_impossible_arguments(
    ext: ModuleType, function: str, args: tuple[object, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        getattr(ext, function)(*args)


def test_block_checksums_cover_each_64k_block_and_a_short_tail() -> None:
    data = bytes(range(256)) * (BLOCK // 256) * 2 + b"tail"
    expected = [
        blocksum.crc32c_python(data[:BLOCK]),
        blocksum.crc32c_python(data[BLOCK:-4]),
        blocksum.crc32c_python(b"tail"),
    ]
    assert blocksum.block_checksums(data) == expected


def test_older_checkpoints_algorithm_is_zlib_crc32_of_each_block() -> None:
    data = os.urandom(2 * BLOCK + 9)
    expected = [zlib.crc32(data[:BLOCK]), zlib.crc32(data[BLOCK : 2 * BLOCK]), zlib.crc32(data[2 * BLOCK :])]
    assert blocksum.block_checksums(data, blocksum.CRC32_X64K) == expected


def test_file_checksum_is_the_algorithms_crc_of_the_packed_block_checksums() -> None:
    sums = [1, 2, 0xFFFFFFFF]
    packed = blocksum.pack(sums)
    assert (
        blocksum.file_checksum_of_blocks(sums, blocksum.CRC32C_X64K),
        blocksum.file_checksum_of_blocks(sums, blocksum.CRC32_X64K),
    ) == (blocksum.crc32c_python(packed), zlib.crc32(packed))


def test_unknown_algorithm_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'sha256' is not one of crc32cx64k, crc32x64k"):
        blocksum.block_checksums(b"x", "sha256")


def test_recorded_checksums_verify_with_the_algorithm_they_name() -> None:
    data = os.urandom(BLOCK + 1)
    old = checksums.checksum_bytes(data, blocksum.CRC32_X64K)
    new = checksums.checksum_bytes(data)
    assert (
        old.split(":")[0],
        new.split(":")[0],
        checksums.checksum_matches(data, old),
        checksums.checksum_matches(data, new),
        checksums.checksum_matches(data + b"!", new),
    ) == ("crc32x64k", "crc32cx64k", True, True, False)


def test_without_the_extension_checksums_are_the_same_and_say_python(tmp_path: Path) -> None:
    # A source checkout that was never built: importing the extension fails.
    probe = (
        "import sys, json\n"
        "sys.modules['ftsup.store._blocksum'] = None\n"
        "from ftsup.store import blocksum, checksums\n"
        "data = bytes(range(256)) * 700\n"
        "sums = [blocksum.implementation(), checksums.checksum_bytes(data), blocksum.block_checksums(data)]\n"
        "print(json.dumps(sums))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = bytes(range(256)) * 700
    assert json.loads(done.stdout) == ["python", checksums.checksum_bytes(data), blocksum.block_checksums(data)]


# --------------------------------------------------------------------------- streaming / fused copy


def _pieces(rng: random.Random, total: int) -> list[tuple[int, int]]:
    """Random (offset, length) pieces covering [0, total) in order: tiny, unaligned, several blocks."""
    out, pos = [], 0
    while pos < total:
        n = min(total - pos, rng.choice([1, 7, 4096, BLOCK - 3, BLOCK, 3 * BLOCK, 3 * BLOCK + 5, 7 * BLOCK + 1]))
        out.append((pos, n))
        pos += n
    return out


@pytest.mark.parametrize("software", [False, True], ids=["best", "software"])
def test_streamed_block_checksums_match_the_one_call_ones_for_any_pieces(ext, software):
    rng = random.Random(7)
    for trial in range(40):
        total = rng.choice([0, 1, BLOCK, 3 * BLOCK, rng.randint(1, 12 * BLOCK)])
        data = rng.randbytes(total)
        dst = bytearray(total + 16)
        skew = trial % 2  # an unaligned destination takes the plain-store path
        view = memoryview(dst)[skew : skew + total]
        regs = array.array("I", [0xDEADBEEF] * max(1, -(-total // BLOCK)))
        for off, n in _pieces(rng, total):
            if rng.random() < 0.5:
                ext.copy_blocks_update(view[off : off + n], data[off : off + n], off, regs, software=software)
            else:
                view[off : off + n] = data[off : off + n]
                ext.blocks_update(data[off : off + n], off, regs, software=software)
        got = [r ^ 0xFFFFFFFF for r in regs[: -(-total // BLOCK)]]
        assert bytes(view) == data, trial
        assert got == blocksum.block_checksums(data), trial


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@pytest.mark.parametrize("dst_skew", [0, 4, 13])
@pytest.mark.parametrize("rel", [0, 16, 2048, 4096 - 129, 4096 - 128, 4096 - 64, 4096 - 4, 4095])
def test_fused_copy_is_exact_wherever_the_source_lies_against_the_destination(ext, rel, dst_skew):
    """The copy takes another route where the source trails the destination by less than 128
    bytes modulo 4096 (store-to-load aliasing, see _blocksum.c), and plain stores at the ends
    of an unaligned destination: every route gives the same bytes and checksums."""
    total = 7 * BLOCK + 100
    data = random.Random(rel * 16 + dst_skew).randbytes(total)
    dbuf, sbuf = bytearray(total + 2 * 4096), bytearray(total + 2 * 4096)
    d0 = (dst_skew - _address(dbuf)) % 4096
    s0 = (dst_skew + rel - _address(sbuf)) % 4096
    sbuf[s0 : s0 + total] = data
    dst, src = memoryview(dbuf)[d0 : d0 + total], memoryview(sbuf)[s0 : s0 + total]
    assert (_address(sbuf) + s0 - _address(dbuf) - d0) % 4096 == rel
    regs = array.array("I", bytes(4 * -(-total // BLOCK)))
    for off, n in [(0, 100), (100, 5 * BLOCK), (5 * BLOCK + 100, total - 5 * BLOCK - 100)]:
        ext.copy_blocks_update(dst[off : off + n], src[off : off + n], off, regs)
    assert bytes(dst) == data
    assert [r ^ 0xFFFFFFFF for r in regs] == blocksum.block_checksums(data)
    assert dbuf[:d0] == bytes(d0) and dbuf[d0 + total :] == bytes(len(dbuf) - d0 - total)


def test_streaming_blocks_copy_and_update_give_the_file_checksums(ext):
    rng = random.Random(3)
    total = 9 * BLOCK + 123
    data = rng.randbytes(total)
    dst = memoryview(bytearray(total))
    sums = blocksum.StreamingBlocks(total)
    for i, (off, n) in enumerate(_pieces(rng, total)):
        if i % 2:
            sums.copy(dst[off : off + n], data[off : off + n], off)
        else:
            dst[off : off + n] = data[off : off + n]
            sums.update(dst[off : off + n], off)
    assert bytes(dst) == data
    assert sums.finish() == blocksum.block_checksums(data)


def test_streaming_blocks_refuse_gaps_overlaps_overruns_and_unfinished_files(ext):
    sums = blocksum.StreamingBlocks(100)
    sums.update(bytes(10), 0)
    with pytest.raises(ValueError, match="expected offset 10, got 11"):
        sums.update(bytes(5), 11)
    with pytest.raises(ValueError, match="expected offset 10, got 5"):
        sums.update(bytes(5), 5)
    with pytest.raises(ValueError, match="past the file's 100 bytes"):
        sums.update(bytes(91), 10)
    with pytest.raises(ValueError, match="90 bytes of the file were never seen"):
        sums.finish()
    with pytest.raises(ValueError, match="must be the same size"):
        sums.copy(memoryview(bytearray(3)), bytes(4), 10)


def test_block_registers_array_too_short_is_an_error_not_an_overrun(ext):
    regs = array.array("I", [0])
    with pytest.raises(ValueError, match="at least 2 uint32"):
        ext.blocks_update(bytes(BLOCK + 1), 0, regs)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        ext.blocks_update(bytes(1), -1, regs)
    with pytest.raises(TypeError):
        ext.copy_blocks_update(bytes(1), bytes(1), 0, regs)  # a read-only destination


def test_fused_copy_is_used_exactly_where_the_crc_instruction_is(ext):
    assert blocksum.fused_copy_available() == (ext.implementation() == "sse4.2")
