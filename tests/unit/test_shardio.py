"""Verified ranged reads of a shard file: pieces read by several threads come back whole and in
place, and a corrupt block anywhere is named by its byte range, never returned."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import torch

from ftsup.store import checksums, durable, layout
from ftsup.store.errors import CheckpointCorruptError
from ftsup.trainer.checkpoint.shardio import PAGE, READ_PIECE, VerifiedFile, aligned_buffer, read_files, write_shard

B = layout.CHECKSUM_BLOCK_BYTES


def _shard(tmp_path: Path, size: int) -> tuple[bytes, VerifiedFile]:
    data = random.Random(size).randbytes(size)
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    crcs = checksums.block_crcs(data)
    crc_path = tmp_path / "shard.crc32"
    crc_path.write_bytes(checksums.pack_block_crcs(crcs))
    vf = VerifiedFile(str(path), size, checksums.checksum_from_block_crcs(crcs), str(crc_path), "shard.bin")
    return data, vf


def test_ranges_spanning_many_pieces_come_back_exactly(tmp_path):
    size = 3 * READ_PIECE + 5 * B + 123  # several pieces per region, a short last block
    data, vf = _shard(tmp_path, size)
    wanted = [(10, 20), (B - 1, 2 * READ_PIECE + 7), (size - 50, size)]
    regions = vf.read_ranges(wanted)
    for s, e in wanted:
        base, region = next((b, r) for b, r in regions if b <= s and e <= b + r.numel())
        assert bytes(region[s - base : e - base].numpy()) == data[s:e]
    assert vf.bytes_read == os.path.getsize(tmp_path / "shard.crc32") + sum(r.numel() for _, r in regions)


@pytest.mark.parametrize("where", [5, READ_PIECE + 3 * B + 17, 3 * READ_PIECE - 1])
def test_a_flipped_byte_in_any_piece_is_named_by_its_block(tmp_path, where):
    size = 3 * READ_PIECE + B
    data, vf = _shard(tmp_path, size)
    with open(tmp_path / "shard.bin", "r+b") as f:
        f.seek(where)
        f.write(bytes([data[where] ^ 0x40]))
    block = where // B * B
    with pytest.raises(CheckpointCorruptError, match=rf"shard.bin: checksum mismatch in bytes {block}..{block + B}"):
        vf.read_ranges([(0, size)])


def test_a_file_shorter_than_its_manifest_says_is_corrupt(tmp_path):
    size = READ_PIECE + B
    _, vf = _shard(tmp_path, size)
    os.truncate(tmp_path / "shard.bin", READ_PIECE + 100)
    with pytest.raises(CheckpointCorruptError, match=f"size {READ_PIECE + 100} != recorded {size}"):
        vf.read_ranges([(0, size)])


def test_regions_are_separate_tensors_the_caller_may_keep(tmp_path):
    data, vf = _shard(tmp_path, 4 * B)
    (s0, r0), (s1, r1) = vf.read_ranges([(0, 10), (3 * B, 3 * B + 10)])
    assert (s0, s1) == (0, 3 * B) and r0.numel() == B and r1.numel() == B
    assert torch.equal(r1[:10], torch.frombuffer(bytearray(data[3 * B : 3 * B + 10]), dtype=torch.uint8))


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore over a read-only map)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_reads_bypass_the_page_cache_where_the_filesystem_allows(tmp_path):
    size = 2 * READ_PIECE + 3 * B + 100  # an unaligned tail: its last page goes through the cache
    data, vf = _shard(tmp_path, size)
    path = tmp_path / "shard.bin"
    _evict(path)
    if _cached_pages(path) != 0:
        pytest.skip("this filesystem keeps clean pages cached after POSIX_FADV_DONTNEED")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    ((start, region),) = vf.read_ranges([(0, size)])
    assert start == 0 and bytes(region.numpy()) == data
    assert _cached_pages(path) <= 1  # at most the tail page


def test_many_regions_of_several_files_are_each_page_aligned_and_read_around_the_cache(tmp_path):
    """A reshard's many small regions (including unaligned file tails) share one buffer; each
    region must still start on a page, or O_DIRECT would refuse it and the read go through the
    cache."""
    files = []
    for i, size in enumerate((5 * B + 100, 7 * B + 4000)):
        (tmp_path / str(i)).mkdir()
        files.append(_shard(tmp_path / str(i), size))
        _evict(tmp_path / str(i) / "shard.bin")
    if _cached_pages(tmp_path / "0" / "shard.bin") != 0:
        pytest.skip("this filesystem keeps clean pages cached after POSIX_FADV_DONTNEED")
    try:
        os.close(os.open(tmp_path / "0" / "shard.bin", os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    asks = [[(10, 20), (2 * B + 5, 2 * B + 9), (5 * B + 1, 5 * B + 100)], [(B, 2 * B), (4 * B, 7 * B + 4000)]]
    got = read_files([(vf, ranges) for (_, vf), ranges in zip(files, asks, strict=True)])
    for (data, vf), ranges, regions in zip(files, asks, got, strict=True):
        assert [s for s, _ in regions] == sorted({s // B * B for s, _ in ranges})  # none merged here
        for s, region in regions:
            assert region.data_ptr() % PAGE == 0
            assert bytes(region.numpy()) == data[s : s + region.numel()]
        for s, e in ranges:
            base, region = next((b, r) for b, r in regions if b <= s and e <= b + r.numel())
            assert bytes(region[s - base : e - base].numpy()) == data[s:e]
        assert _cached_pages(Path(vf.path)) <= 1  # at most the unaligned tail page


def test_without_o_direct_everything_is_read_through_the_cache(tmp_path, monkeypatch):
    from ftsup.trainer.checkpoint import shardio

    monkeypatch.setattr(shardio, "open_direct", lambda path, mode=os.O_WRONLY: None)  # as on a refusing fs
    size = READ_PIECE + 2 * B + 7
    data, vf = _shard(tmp_path, size)
    _evict(tmp_path / "shard.bin")
    ((start, region),) = vf.read_ranges([(0, size)])
    assert start == 0 and bytes(region.numpy()) == data
    assert _cached_pages(tmp_path / "shard.bin") == -(-size // PAGE)


def test_an_o_direct_read_refused_with_einval_falls_back_to_the_cache(tmp_path, monkeypatch):
    from ftsup.trainer.checkpoint import shardio

    direct_fds: set[int] = set()
    real_open, real_preadv = shardio.open_direct, os.preadv

    def open_direct(path: str, mode: int = os.O_WRONLY) -> int | None:
        fd = real_open(path, mode)
        if fd is not None:
            direct_fds.add(fd)
        return fd

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fd in direct_fds:  # a filesystem that opens O_DIRECT but wants another alignment
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(shardio, "open_direct", open_direct)
    monkeypatch.setattr(os, "preadv", preadv)
    size = 2 * READ_PIECE + 5
    data, vf = _shard(tmp_path, size)
    ((start, region),) = vf.read_ranges([(0, size)])
    if not direct_fds:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    assert start == 0 and bytes(region.numpy()) == data


@pytest.mark.parametrize("old_size", [0, 5000, 3 * PAGE + 17, 4 * 65536 + 123])
def test_a_recycled_file_written_over_holds_exactly_the_new_bytes(tmp_path, old_size):
    total = 2 * 65536 + 300  # an unaligned tail, so both the O_DIRECT and the buffered path write
    buf = aligned_buffer(total)
    buf.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    path = tmp_path / "recycled.safetensors"
    path.write_bytes(b"\xee" * old_size)
    size, crcs = write_shard(str(path), buf, reuse=True)
    assert size == total == path.stat().st_size
    assert path.read_bytes() == bytes(buf.numpy())
    assert crcs == checksums.block_crcs(bytes(buf.numpy()))


def test_a_new_shard_file_is_never_written_over(tmp_path):
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"committed")
    with pytest.raises(FileExistsError):
        write_shard(str(path), aligned_buffer(4096))
    assert path.read_bytes() == b"committed"


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_a_spare_that_is_not_a_plain_file_of_its_own_is_replaced_never_followed(tmp_path, kind):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the checkpoint's")
    path = tmp_path / "recycled.safetensors"
    if kind == "symlink":
        path.symlink_to(outside)
    elif kind == "hardlink":
        os.link(outside, path)
    else:
        os.mkfifo(path)
    buf = aligned_buffer(3 * PAGE)
    buf.fill_(7)
    write_shard(str(path), buf, reuse=True)
    assert outside.read_bytes() == b"not the checkpoint's"
    assert not path.is_symlink() and path.stat().st_nlink == 1
    assert path.read_bytes() == bytes([7]) * (3 * PAGE)


def _fetched(data: bytes, handed: list[int], served: bytes | None = None) -> VerifiedFile:
    """A VerifiedFile of `data` as a durable tier serves it (`served`: other bytes it serves instead): each ranged
    read handed over in 1 MiB pieces (`DurableTier.read_pieces`' contract), each piece's offset kept in `handed`."""
    crcs = checksums.block_crcs(data)
    served = data if served is None else served

    def fetch(offset: int, length: int, each) -> None:  # type: ignore[no-untyped-def]
        for at in range(offset, offset + length, durable.READ_PIECE_BYTES):
            handed.append(at)
            each(at, served[at : min(at + durable.READ_PIECE_BYTES, offset + length)])

    checksum = checksums.checksum_from_block_crcs(crcs)
    return VerifiedFile.fetched(fetch, len(data), checksum, checksums.pack_block_crcs(crcs), "s.bin", "s3://b/s.bin")


def test_a_fetched_file_is_verified_a_piece_at_a_time_as_each_piece_lands(tmp_path):
    size = 2 * READ_PIECE + 3 * B + 11
    data = random.Random(7).randbytes(size)
    handed: list[int] = []
    (((start, region),),) = read_files([(_fetched(data, handed), [(0, size)])], threads=2, piece=READ_PIECE)
    assert (start, bytes(region.numpy())) == (0, data)
    bad = 2 * durable.READ_PIECE_BYTES + 5  # in the third piece of the first ranged read
    flipped = data[:bad] + bytes([data[bad] ^ 1]) + data[bad + 1 :]
    handed.clear()
    block = bad // B * B
    with pytest.raises(CheckpointCorruptError, match=rf"s3://b/s.bin: checksum mismatch in bytes {block}..{block + B}"):
        read_files([(_fetched(data, handed, flipped), [(0, size)])], threads=1, piece=READ_PIECE)
    first = [at for at in handed if at < READ_PIECE]  # the first ranged read's pieces (the others run on)
    assert first == [0, durable.READ_PIECE_BYTES, bad - 5]  # it stopped at the piece that did not verify


def test_a_fetched_read_handed_fewer_bytes_than_asked_is_corrupt() -> None:
    data = random.Random(8).randbytes(3 * B)
    crcs = checksums.block_crcs(data)
    vf = VerifiedFile.fetched(
        lambda offset, length, each: each(offset, data[offset : offset + B]),
        len(data),
        checksums.checksum_from_block_crcs(crcs),
        checksums.pack_block_crcs(crcs),
        "s.bin",
        "s3://b/s.bin",
    )
    with pytest.raises(CheckpointCorruptError, match=rf"s3://b/s.bin: {B} bytes at 0, asked for {3 * B}"):
        vf.read_ranges([(0, 3 * B)])


def _vm_flags(t: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping that holds `t`'s first byte (Linux's /proc/self/smaps)."""
    addr = t.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_a_loads_read_buffer_is_never_asked_for_huge_pages(tmp_path):
    _, vf = _shard(tmp_path, 2 * READ_PIECE)
    [[(_, region)]] = read_files([(vf, [(0, 2 * READ_PIECE)])])
    assert ("hg" in _vm_flags(aligned_buffer(2 * READ_PIECE, populate=False)), "hg" in _vm_flags(region)) == (
        True,
        False,
    )
