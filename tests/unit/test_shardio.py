"""Verified ranged reads of a shard file: pieces read by several threads come back whole and in
place, and a corrupt block anywhere is named by its byte range, never returned."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import layout
from trainer.checkpoint.errors import CheckpointCorruptError
from trainer.checkpoint.shardio import READ_PIECE, VerifiedFile

B = layout.CHECKSUM_BLOCK_BYTES


def _shard(tmp_path: Path, size: int) -> tuple[bytes, VerifiedFile]:
    data = random.Random(size).randbytes(size)
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    crcs = layout.block_crcs(data)
    crc_path = tmp_path / "shard.crc32"
    crc_path.write_bytes(layout.pack_block_crcs(crcs))
    vf = VerifiedFile(str(path), size, layout.checksum_from_block_crcs(crcs), str(crc_path), "shard.bin")
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
    with pytest.raises(CheckpointCorruptError, match="file ends early"):
        vf.read_ranges([(0, size)])


def test_regions_are_separate_tensors_the_caller_may_keep(tmp_path):
    data, vf = _shard(tmp_path, 4 * B)
    (s0, r0), (s1, r1) = vf.read_ranges([(0, 10), (3 * B, 3 * B + 10)])
    assert (s0, s1) == (0, 3 * B) and r0.numel() == B and r1.numel() == B
    assert torch.equal(r1[:10], torch.frombuffer(bytearray(data[3 * B : 3 * B + 10]), dtype=torch.uint8))
