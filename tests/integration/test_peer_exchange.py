"""Peer messages over real gloo (`peers.exchange`, tests/bin/peer_exchange.py): an honest part is kept; an offer of
other sizes is refused before a byte of its files moves; a file that vanished once offered, or whose bytes differ from
the manifest's, is never kept; a check or a read raising what none expects fails that part only; neither side is ever
left waiting (a rank stuck in a round would hold the other until gloo's 30-minute timeout, past the test's 60 s)."""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftsup.trainer.checkpoint.peers import mapped_file
from tests.helpers import mounted_tmpfs
from tests.procs import torchrun

pytestmark = pytest.mark.multiprocess


def _exchange(case: str, tmp_path: Path) -> dict:
    r = torchrun("peer_exchange.py", [case, "--out", str(tmp_path / "out.json")], nproc=2, timeout=60)
    assert r.returncode == 0, r.output[-4000:]
    return json.loads((tmp_path / "out.json").read_text())


def test_an_honest_part_is_kept_whole(tmp_path: Path) -> None:
    got = _exchange("honest", tmp_path)
    assert got == {
        "sender_error": None,
        "receiver_error": None,
        "kept": {"rank-00000.json": True, "shard-00000.safetensors": True},
    }


def test_an_offer_of_other_sizes_is_refused_before_its_files_move(tmp_path: Path) -> None:
    got = _exchange("lying", tmp_path)
    assert (got["kept"], "refused the offer" in got["sender_error"]) == ({}, True)
    assert "1000000000 bytes (the manifest records 11 bytes)" in got["receiver_error"]


@pytest.mark.parametrize("case", ["vanished", "flipped"])
def test_a_file_not_as_the_manifest_records_is_never_kept(case: str, tmp_path: Path) -> None:
    got = _exchange(case, tmp_path)
    assert got["kept"] == {"rank-00000.json": True}
    assert "shard-00000.safetensors received from group rank 0: checksum mismatch" in got["receiver_error"]


def test_a_check_raising_what_no_check_expects_refuses_the_offer_and_neither_side_waits(tmp_path: Path) -> None:
    got = _exchange("check-bug", tmp_path)
    assert (got["kept"], "refused the offer" in got["sender_error"]) == ({}, True)
    assert got["receiver_error"] == "ValueError: a check that fails as no check should"


def test_a_read_raising_what_no_read_expects_sends_zeros_that_fail_there(tmp_path: Path) -> None:
    got = _exchange("read-bug", tmp_path)
    assert got["kept"] == {"rank-00000.json": True}
    assert got["sender_error"] == "shard-00000.safetensors: KeyError: 'shard-00000.safetensors'"
    assert "shard-00000.safetensors received from group rank 0: checksum mismatch" in got["receiver_error"]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / "tmpfs", "4m")


def test_a_file_received_into_a_full_memory_tier_is_an_error_not_a_sigbus(small_tmpfs: Path) -> None:
    # A receive writes the file through its mapping: a page the tmpfs cannot give would be a SIGBUS in gloo's thread,
    # killing the rank; the space is taken first, so a full tier is an error of that replica alone.
    with pytest.raises(OSError) as e:
        mapped_file(small_tmpfs, "shard-00001.safetensors", 64 << 20)
    assert e.value.errno == errno.ENOSPC
    t = mapped_file(small_tmpfs, "shard-00002.safetensors", 1 << 20)
    t.fill_(7)
    del t
    assert (small_tmpfs / "shard-00002.safetensors").read_bytes() == bytes([7]) * (1 << 20)
    (small_tmpfs / "shard-00003.safetensors").symlink_to(small_tmpfs / "elsewhere")
    with pytest.raises(FileExistsError):  # never written through a link planted there
        mapped_file(small_tmpfs, "shard-00003.safetensors", 10)
    assert not (small_tmpfs / "elsewhere").exists()
