"""A node whose memory cannot hold its share of the memory tier (its part, its replicas, as many as it keeps, one
save more) is refused before start, naming checkpoint.memory with the numbers; without a checkpoint yet, or with
room, it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup.supervisor.config.job import JobConfig, parse_config
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.run import memroom
from ftsup.supervisor.state import memview
from tests.helpers import default_files, make_fake_checkpoint


def config(tmp: Path, keep_last: int = 1) -> JobConfig:
    checkpoint = {"dir": str(tmp / "ckpt"), "memory": {"dir": str(tmp / "mem"), "keep_last": keep_last}}
    raw = {"job": {"command": ["true"], "run_id": "gpt-7"}, "checkpoint": checkpoint}
    return parse_config(raw, source="job.yaml", base_dir=tmp, hostname="n")


def test_a_node_each_of_whose_parts_takes_one_node_and_its_peers_share() -> None:
    assert memroom.need_bytes(1000, 4, 1, 2) == 250 * 2 * 3
    assert memroom.need_bytes(1000, 1, 3, 1) == 1000 * 2  # one node: no peers


def test_a_memory_too_small_for_the_share_is_refused_with_the_numbers(tmp_path: Path) -> None:
    make_fake_checkpoint(tmp_path / "ckpt", 5, default_files())
    with pytest.raises(ConfigError, match="checkpoint.memory") as e:
        memroom.check(config(tmp_path, keep_last=2), free=lambda path: 100)
    assert "needs 0.00 GiB" in str(e.value) and "step 5" in str(e.value) and str(tmp_path / "mem") in str(e.value)


def test_room_enough_or_no_checkpoint_yet_starts(tmp_path: Path) -> None:
    memroom.check(config(tmp_path), free=lambda path: 0)  # nothing saved: the size is not known
    make_fake_checkpoint(tmp_path / "ckpt", 5, default_files())
    memroom.check(config(tmp_path), free=lambda path: 10**9)


def test_the_tiers_own_copies_count_as_room(tmp_path: Path) -> None:
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "old").write_bytes(b"x" * 5000)
    (tmp_path / "mem" / "sub").mkdir()
    (tmp_path / "mem" / "sub" / "part").write_bytes(b"x" * 7)
    (tmp_path / "mem" / "link").symlink_to(tmp_path / "elsewhere")
    assert (memview.held_bytes(tmp_path / "mem"), memview.held_bytes(tmp_path / "none")) == (
        5007 + len(str(tmp_path / "elsewhere")),
        0,
    )
