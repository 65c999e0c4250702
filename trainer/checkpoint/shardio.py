"""One rank's shard file: its layout (a safetensors file), page-aligned buffers, the O_DIRECT write, and verified
ranged reads (ftsup/store/DESIGN.md, File format; trainer/checkpoint/DESIGN.md, Writing, Loading).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import stat
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ftsup.store import safefile
from ftsup.store.checksums import (
    block_crcs,
    checksum_algorithm,
    checksum_from_block_crcs,
    unpack_block_crcs,
)
from ftsup.store.errors import CheckpointCorruptError
from ftsup.store.layout import CHECKSUM_BLOCK_BYTES, SIDECAR_MAX_BYTES, Manifest
from ftsup.trainer.checkpoint import codec

PAGE = 4096
WRITE_BLOCK = 64 * 1024 * 1024
READ_PIECE = 4 * 1024 * 1024  # a multiple of the checksum block
# Per rank. A reshard reads many regions smaller than a piece (FSDP2 rows: a rank's part of
# each tensor), so the number of reads in flight, not their size, keeps the disk busy
# (trainer/checkpoint/DESIGN.md, Loading).
READ_THREADS = 32


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ChunkSlot:
    """Where one saved chunk (a DCP write item) lives in a shard file."""

    fqn: str
    offsets: tuple[int, ...]  # the chunk's offsets in the global tensor
    sizes: tuple[int, ...]
    dtype: torch.dtype
    byte_offset: int  # from the start of the file
    nbytes: int

    @property
    def name(self) -> str:
        return f"{self.fqn}@{','.join(map(str, self.offsets))}"


@dataclass(frozen=True)
class ShardLayout:
    slots: tuple[ChunkSlot, ...]
    header: bytes  # length prefix + padded JSON header
    total_size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


def build_layout(chunks: Sequence[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype]]) -> ShardLayout:
    """Deterministic layout of (fqn, offsets, sizes, dtype) chunks: same input, same file."""
    ordered = sorted(chunks, key=lambda c: (-c[3].itemsize, c[0], c[1]))
    rel: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype, int, int]] = []
    pos = 0
    for fqn, offsets, sizes, dtype in ordered:
        n = dtype.itemsize
        for s in sizes:
            n *= s
        rel.append((fqn, tuple(offsets), tuple(sizes), dtype, pos, n))
        pos += n
    header_obj: dict[str, object] = {"__metadata__": {"format": "pt", "producer": "ftsup"}}
    for fqn, offsets, sizes, dtype, start, n in rel:
        name = f"{fqn}@{','.join(map(str, offsets))}"
        st = codec.safetensors_header(dtype, sizes, fqn)
        # A dtype safetensors cannot describe (complex128) is stored as its raw bytes; the
        # checkpoint's own metadata records the dtype.
        st_dtype, shape = st if st is not None else ("U8", [n])
        header_obj[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [start, start + n]}
    raw = json.dumps(header_obj, separators=(",", ":")).encode()
    data_start = round_up(8 + len(raw), PAGE)
    raw = raw + b" " * (data_start - 8 - len(raw))
    header = struct.pack("<Q", len(raw)) + raw
    slots = tuple(
        ChunkSlot(fqn, offsets, sizes, dtype, data_start + start, n) for fqn, offsets, sizes, dtype, start, n in rel
    )
    return ShardLayout(slots=slots, header=header, total_size=data_start + pos)


# --------------------------------------------------------------------------- host buffers


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python's mmap module yet


def aligned_buffer(nbytes: int, *, pin: bool = False, populate: bool = True, huge: bool = True) -> torch.Tensor:
    """A page-aligned uint8 CPU tensor of `nbytes` (pinned when asked, for CUDA staging).

    Unpinned buffers are anonymous mappings asked for huge pages and populated up front: faulting
    in fresh 4 KiB pages one by one during the first copy is slow on a VM, and exactly the stall a
    reused staging buffer exists to avoid (trainer/checkpoint/DESIGN.md, Staging). `populate=False` leaves
    that to the first write (read buffers: the kernel faults them in inside `preadv`, in the
    reading threads, in parallel, instead of in one populate call up front). `huge=False`: 4 KiB pages only (a
    load's read buffer: a fresh huge page faulted in inside a read stalled that read for up to seconds on a VM,
    trainer/checkpoint/DESIGN.md, Loading).
    """
    if pin:
        raw = torch.empty(round_up(max(nbytes, 1), PAGE) + PAGE, dtype=torch.uint8, pin_memory=True)
        skew = (-raw.data_ptr()) % PAGE
        return raw[skew : skew + nbytes]
    size = round_up(max(nbytes, 1), PAGE)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in (getattr(mmap, "MADV_HUGEPAGE", None) if huge else None, _MADV_POPULATE_WRITE if populate else None):
        if advice is not None:
            try:
                m.madvise(advice)
            except OSError:  # an older kernel: pages fault in on first use instead
                pass
    return torch.frombuffer(m, dtype=torch.uint8)[:nbytes]


def as_memoryview(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- write


def write_shard(
    path: str, buf: torch.Tensor, *, o_direct: bool = True, crcs: list[int] | None = None, reuse: bool = False
) -> tuple[int, list[int]]:
    """Write `buf` (page-aligned uint8) as the file `path`, fsync it; return (size, block CRCs).

    The aligned bulk goes through O_DIRECT where the filesystem allows it (tmpfs does not).
    `crcs`: the buffer's block checksums when the caller already has them (staging computed
    them); otherwise they are computed concurrently from memory, not by re-reading the file.
    `reuse`: `path` is an existing file (a recycled shard) to write over and cut to size;
    otherwise it must not exist yet.
    """
    total = buf.numel()
    mv = as_memoryview(buf)
    if crcs is not None:
        if len(crcs) != -(-total // CHECKSUM_BLOCK_BYTES):
            raise ValueError(f"{len(crcs)} block checksums given for {total} bytes")
        _write_file(path, mv, total, o_direct, reuse)
        return total, crcs
    crcs = []
    crc_error: list[BaseException] = []

    def checksum() -> None:
        try:
            block_crcs(mv, crcs)
        except BaseException as e:  # surfaced below; a thread must not swallow it
            crc_error.append(e)

    crc_thread = threading.Thread(target=checksum, name="ftsup-ckpt-crc", daemon=True)
    crc_thread.start()
    try:
        _write_file(path, mv, total, o_direct, reuse)
    finally:
        crc_thread.join()
    if crc_error:
        raise crc_error[0]
    return total, crcs


def _write_file(path: str, mv: memoryview, total: int, o_direct: bool, reuse: bool) -> None:
    fd = _open_recycled(path) if reuse else None
    if fd is None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if reuse:
            os.ftruncate(fd, total)  # every byte below is written; a longer old file is cut
        bulk = total // PAGE * PAGE if o_direct else 0
        if bulk:
            dfd = open_direct(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
            if dfd is not None and not os.path.samestat(os.fstat(dfd), os.fstat(fd)):
                os.close(dfd)  # the name was swapped meantime: write only through `fd`
                dfd = None
            if dfd is None:
                bulk = 0
            else:
                try:
                    _write_all(dfd, mv, 0, bulk)
                finally:
                    os.close(dfd)
        _write_all(fd, mv, bulk, total)
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_recycled(path: str) -> int | None:
    """`path` opened for writing over, if it is a plain file of its own; otherwise it is removed
    (the caller creates a new file). A symlink or a hard link in the pool must never lead a save
    to write over a file outside the checkpoint."""
    try:
        # O_NONBLOCK: a FIFO without a reader fails (ENXIO) instead of blocking the writer.
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENOENT, errno.ENXIO):
            raise
    else:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
            return fd
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # removes the link, never what it points to
    return None


def open_direct(path: str, mode: int = os.O_WRONLY) -> int | None:
    """`path` opened with O_DIRECT, or None where the filesystem (tmpfs before Linux 6.6) refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, mode | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _write_all(fd: int, mv: memoryview, start: int, end: int) -> None:
    pos = start
    while pos < end:
        n = os.pwrite(fd, mv[pos : min(end, pos + WRITE_BLOCK)], pos)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        pos += n


# --------------------------------------------------------------------------- read


class VerifiedFile:
    """Ranged, checksum-verified reads from one shard file of a committed checkpoint: a local file, or one whose
    bytes come from `fetch(offset, length, each)` (a durable tier's ranged reads, `VerifiedFile.fetched`)."""

    fetch: Callable[[int, int, Callable[[int, bytes], None]], None] | None = None
    shown: str
    """The file as errors name it (its path in the checkpoint; a durable tier's object)."""

    def __init__(self, path: str, size: int, checksum: str, crc_path: str, rel: str):
        self.path = path
        self.rel = rel
        self.shown = rel
        self.size = size
        # A regular file of exactly one checksum per block: never a FIFO, a device or a link.
        exact = 4 * -(-size // CHECKSUM_BLOCK_BYTES)
        raw = safefile.read_regular(crc_path, f"{rel}: its block checksums", SIDECAR_MAX_BYTES, exact=exact)
        self._sidecar(raw, checksum)

    def _sidecar(self, raw: bytes, checksum: str) -> None:
        blocks = -(-self.size // CHECKSUM_BLOCK_BYTES)
        if len(raw) != 4 * blocks:
            raise CheckpointCorruptError(
                f"{self.shown}: {len(raw)} bytes of block checksums, not {4 * blocks}", file=self.rel
            )
        self.bytes_read = len(raw)
        self.crcs = unpack_block_crcs(raw)
        # Checkpoints of earlier versions use another algorithm; the recorded checksum names it.
        self.algorithm = checksum_algorithm(checksum)
        # The file's checksum is defined over its block CRCs, so the sidecar verifies itself.
        if checksum_from_block_crcs(self.crcs, self.algorithm) != checksum or len(self.crcs) != blocks:
            raise CheckpointCorruptError(f"{self.shown}: block checksums do not match the manifest", file=self.rel)

    @classmethod
    def in_checkpoint(cls, ckpt: str | os.PathLike[str], manifest: Manifest, rel: str, crc_rel: str) -> VerifiedFile:
        """The shard file `rel` of the checkpoint directory `ckpt`, with its block checksums in `crc_rel` (both
        resolved inside `ckpt`), checked against `manifest`'s entry of it."""
        entry = manifest.files[rel]
        path, crc_path = safefile.resolve_inside(ckpt, rel), safefile.resolve_inside(ckpt, crc_rel)
        return cls(str(path), entry.size, entry.checksum, str(crc_path), rel)

    @classmethod
    def fetched(
        cls,
        fetch: Callable[[int, int, Callable[[int, bytes], None]], None],
        size: int,
        checksum: str,
        sidecar: bytes,
        rel: str,
        shown: str,
    ) -> VerifiedFile:
        """Ranged reads by `fetch(offset, length, each)`, which hands the `length` bytes at `offset` to
        `each(offset, data)` in file order, in pieces of whole checksum blocks (`DurableTier.read_pieces`), verified
        against the block checksums `sidecar` holds (its bytes, checked here against the manifest's `checksum`);
        errors name `shown`."""
        vf = cls.__new__(cls)
        vf.path, vf.rel, vf.shown, vf.size, vf.fetch = shown, rel, shown, size, fetch
        vf._sidecar(sidecar, checksum)
        return vf

    @classmethod
    def of_blocks(cls, path: str, size: int, crcs: list[int], algorithm: str, rel: str) -> VerifiedFile:
        """Ranged reads of a file without a sidecar (a Trainer checkpoint's weights), verified against
        block checksums the caller computed and checked against the manifest."""
        vf = cls.__new__(cls)
        vf.path, vf.rel, vf.size, vf.crcs, vf.algorithm, vf.bytes_read = path, rel, size, crcs, algorithm, 0
        vf.shown = rel
        return vf

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
        """Read the given [start, end) byte ranges; returns (region_start, region) pairs that
        cover them, each region widened to whole checksum blocks and verified."""
        return read_files([(self, ranges)])[0]

    def _spans(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The ranges widened to whole blocks, neighbours merged: [start, end) in file order."""
        B = CHECKSUM_BLOCK_BYTES
        spans = sorted((s // B * B, min(round_up(e, B), self.size)) for s, e in ranges if e > s)
        merged: list[list[int]] = []
        for s, e in spans:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        return [(s, e) for s, e in merged]

    def _read_piece(self, fd: int, direct: int | None, start: int, mv: memoryview) -> None:
        """Fill `mv` with the file's bytes from `start` (a block boundary) and verify its blocks.

        `direct`: an O_DIRECT descriptor of the file, used for the page-aligned bulk (`mv` lies
        in a page-aligned buffer at a multiple of READ_PIECE); the rest (a file's unaligned
        tail, or all of it where the filesystem refuses the alignment) goes through `fd`.
        """
        if self.fetch is not None:
            self._fetch_piece(self.fetch, start, mv)
            return
        pos = 0 if direct is None else _read_direct(direct, start, mv[: len(mv) // PAGE * PAGE])
        while pos < len(mv):
            n = os.preadv(fd, [mv[pos:]], start + pos)
            if n <= 0:
                raise CheckpointCorruptError(f"{self.rel}: file ends early at byte {start + pos}", file=self.rel)
            pos += n
        self._verify(start, mv)

    def _fetch_piece(
        self, fetch: Callable[[int, int, Callable[[int, bytes], None]], None], start: int, mv: memoryview
    ) -> None:
        """Fill `mv` from `fetch`, each piece it hands over copied into place and verified while the CPU's cache
        still holds it (a second pass over the whole read would fetch it back from memory)."""
        done = 0

        def put(at: int, data: bytes) -> None:
            nonlocal done
            if at != start + done or done + len(data) > len(mv):
                raise CheckpointCorruptError(f"{self.shown}: bytes at {at} handed over out of order", file=self.rel)
            mv[done : done + len(data)] = data
            self._verify(at, mv[done : done + len(data)])
            done += len(data)

        fetch(start, len(mv), put)
        if done != len(mv):
            raise CheckpointCorruptError(f"{self.shown}: {done} bytes at {start}, asked for {len(mv)}", file=self.rel)

    def _verify(self, start: int, mv: memoryview) -> None:
        """The blocks of `mv` (the file's bytes from `start`, a block boundary) against the sidecar's checksums."""
        B = CHECKSUM_BLOCK_BYTES
        got = block_crcs(mv, algorithm=self.algorithm)
        want = self.crcs[start // B : start // B + len(got)]
        if got != want:
            bad = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            raise CheckpointCorruptError(
                f"{self.shown}: checksum mismatch in bytes {start + bad * B}..{start + (bad + 1) * B}", file=self.rel
            )


def _read_direct(fd: int, start: int, mv: memoryview) -> int:
    """Read as much of `mv` as O_DIRECT gives; returns how many bytes (a multiple of PAGE)."""
    pos = 0
    while pos < len(mv):
        try:
            n = os.preadv(fd, [mv[pos:]], start + pos)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            break  # this filesystem wants another alignment: the caller reads the rest through the cache
        if n <= 0:
            break
        pos += n
    return pos // PAGE * PAGE


def read_files(
    requests: Sequence[tuple[VerifiedFile, Sequence[tuple[int, int]]]],
    *,
    threads: int = READ_THREADS,
    piece: int = READ_PIECE,
    arena: torch.Tensor | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> list[list[tuple[int, torch.Tensor]]]:
    """`read_ranges` of several files at once; for each file, its (region_start, region) pairs.

    The regions are views of one buffer, which lives as long as any of them: `arena` where the caller gives one
    large enough (an `aligned_buffer` reused from read to read, whose pages are faulted in once), else a new one.
    Every region is read in pieces of whole checksum blocks by READ_THREADS threads that serve all the files
    together (each piece verified by the thread that read it): one read in flight per rank leaves the disk idle
    between requests, and sharing the threads keeps a rank whose share spans two files as busy as the others.
    Pieces are read with O_DIRECT where the filesystem allows it (only a file's unaligned tail goes through the
    page cache): a checkpoint is read once, so caching it only costs CPU the ranks share
    (trainer/checkpoint/DESIGN.md, Loading).

    A file read by `fetch` (a durable tier's) is read the same way, in pieces of `piece` bytes (a multiple of the
    checksum block) by `threads` threads (the tier's connections), each piece verified by its thread.

    `pool`: the reading threads to use instead of `threads` new ones (the engine's, kept from load to load).
    """
    spans = [vf._spans(ranges) for vf, ranges in requests]
    # One buffer for every region, each at a page boundary: a reshard asks for hundreds of regions under 2 MiB.
    # Faulted in by the reading threads inside `preadv` (in the kernel, in parallel), in 4 KiB pages: a huge page
    # faulted in there held its read up to seconds on a VM (trainer/checkpoint/DESIGN.md, Loading). A fetched
    # file's bytes are copied in holding the GIL, so its pages are faulted in up front, once, instead of under
    # that copy.
    need = sum(round_up(e - s, PAGE) for file_spans in spans for s, e in file_spans)
    if arena is None or arena.numel() < need or arena.data_ptr() % PAGE:
        fetched = any(vf.fetch is not None for vf, _ in requests)
        arena = aligned_buffer(need, populate=fetched, huge=fetched)
    out: list[list[tuple[int, torch.Tensor]]] = []
    pos = 0
    for file_spans in spans:
        out.append([])
        for s, e in file_spans:
            out[-1].append((s, arena[pos : pos + e - s]))
            pos += round_up(e - s, PAGE)
    fds: list[int] = []
    try:
        pieces: list[tuple[VerifiedFile, int, int | None, int, memoryview]] = []
        for (vf, _), regions in zip(requests, out, strict=True):
            if vf.fetch is not None:
                for s, region in regions:
                    mv = as_memoryview(region)
                    pieces += [(vf, -1, None, s + lo, mv[lo : lo + piece]) for lo in range(0, len(mv), piece)]
                continue
            fd = safefile.open_regular(vf.path, vf.rel)  # no link, FIFO or device
            fds.append(fd)
            st = os.fstat(fd)
            if st.st_size != vf.size:
                raise CheckpointCorruptError(f"{vf.rel}: size {st.st_size} != recorded {vf.size}", file=vf.rel)
            if hasattr(os, "posix_fadvise"):  # read what we ask for, not a readahead window more
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            direct = open_direct(vf.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            if direct is not None:
                fds.append(direct)
                if not os.path.samestat(os.fstat(direct), st):  # replaced meantime: read it all from `fd`
                    direct = None
            for s, region in regions:
                mv = as_memoryview(region)
                pieces += [(vf, fd, direct, s + lo, mv[lo : lo + piece]) for lo in range(0, len(mv), piece)]
        if pieces and pool is not None:
            _read_all(pool, pieces)
        elif pieces:
            with ThreadPoolExecutor(min(threads, len(pieces)), thread_name_prefix="ftsup-ckpt-read") as own:
                _read_all(own, pieces)
    finally:
        for fd in fds:
            os.close(fd)
    for (vf, _), regions in zip(requests, out, strict=True):
        vf.bytes_read += sum(region.numel() for _, region in regions)
    return out


def _read_all(pool: ThreadPoolExecutor, pieces: list[tuple[VerifiedFile, int, int | None, int, memoryview]]) -> None:
    """Every piece read and verified on `pool`; the first failure in piece order raised once every read has
    finished, so that nothing still writes into the buffer afterwards."""
    futures = [pool.submit(vf._read_piece, fd, direct, start, mv) for vf, fd, direct, start, mv in pieces]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def reading_pool() -> ThreadPoolExecutor:
    """READ_THREADS reading threads for `read_files(pool=...)`, started as reads need them; the caller shuts the
    pool down (`CheckpointEngine.close`)."""
    return ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ftsup-ckpt-read")
