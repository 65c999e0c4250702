"""The durable tier's bounds in time and memory that need no store: the timeout keys of `checkpoint.durable`, the
ranks' deadline for one durable checkpoint, deadlines that nest, and a deep read that plans nothing ahead of what it
reads (ftsup/store/DESIGN.md, "Hostile answers")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ftsup.protocol import DURABLE_TIMEOUT_ENV, RuntimeEnv
from ftsup.store import durable, layout
from ftsup.store.errors import CheckpointCorruptError, DurableTierError
from ftsup.supervisor.cli import main
from ftsup.supervisor.config.job import JobConfig, parse_config
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.run import launcher


def config(durable_section: object, heartbeat: dict[str, Any] | None = None) -> JobConfig:
    raw: dict[str, Any] = {"job": {"command": ["true"]}, "checkpoint": {"dir": "/ckpt", "durable": durable_section}}
    if heartbeat is not None:
        raw["heartbeat"] = heartbeat
    return parse_config(raw, source="job.yaml", base_dir=Path("/job"), hostname="n")


def test_the_timeout_keys_replace_their_defaults_and_reach_the_tiers_options() -> None:
    section = {"url": "s3://bucket/run", "request_timeout_s": 30, "operation_timeout_s": 90.5}
    options = config(section).checkpoint.durable.options()  # type: ignore[union-attr]
    assert (options.request_timeout_s, options.operation_timeout_s) == (30.0, 90.5)


@pytest.mark.parametrize("key", ["request_timeout_s", "operation_timeout_s"])
def test_a_timeout_key_of_zero_is_refused_naming_it(key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config({"url": "s3://bucket/run", key: 0})
    assert f"job.yaml: checkpoint.durable.{key}: must be above 0 seconds, got 0" in str(e.value)


def test_the_ranks_read_one_durable_checkpoint_for_at_most_half_the_save_timeout() -> None:
    short = config({"url": "s3://bucket/run"}, {"save_timeout_s": 40})
    long = config({"url": "s3://bucket/run", "operation_timeout_s": 100}, {"save_timeout_s": 900})
    envs = [launcher.durable_env(cfg)[DURABLE_TIMEOUT_ENV] for cfg in (short, long)]
    assert [RuntimeEnv.from_environ({DURABLE_TIMEOUT_ENV: e}).durable_timeout_s for e in envs] == [20.0, 100.0]


def test_a_rank_without_the_variable_takes_the_tiers_own_timeout() -> None:
    assert RuntimeEnv.from_environ({}).durable_timeout_s is None


def test_a_deadline_inside_a_longer_one_stands_and_the_outer_one_comes_back(tmp_path: Path) -> None:
    with durable.open_tier(str(tmp_path)) as tier:
        with tier.deadline(100):
            outer = tier.ends_at
            with tier.deadline(1000):
                inside_longer = tier.ends_at
            with tier.deadline(5):
                inside_shorter = (tier.ends_at, tier.budget_s)
            after = tier.ends_at
        assert (inside_longer, inside_shorter[1], after, tier.ends_at) == (outer, 5, outer, None)
        assert inside_shorter[0] is not None and outer is not None and inside_shorter[0] < outer


def test_a_deadline_passed_fails_the_read_naming_it(tmp_path: Path) -> None:
    with durable.open_tier(str(tmp_path)) as tier, tier.deadline(1e-9):
        with pytest.raises(DurableTierError, match=r"by its operation's deadline \(1e-09s\)"):
            tier.check_deadline("a read")


class _Claiming(durable.DurableTier):
    """A tier whose one file claims 2**55 bytes and whose every ranged read comes back wrong."""

    def __init__(self) -> None:
        self.location = durable.parse_location("s3://bucket/run")
        self.options = durable.DurableOptions(concurrency=4)
        self.reads = 0

    def read_range(self, step: int, token: str, rel: str, offset: int, length: int) -> bytes:
        self.reads += 1
        raise CheckpointCorruptError(f"{rel}: more than {length} bytes at {offset}", file=rel)

    def upload(self, *a: Any, **k: Any) -> durable.UploadReport:
        raise NotImplementedError

    def list_checkpoints(self, *, deep: bool = False) -> durable.DurableListing:
        raise NotImplementedError

    def inspect(self, step: int, *, deep: bool = False) -> layout.CheckpointInfo:
        raise NotImplementedError

    def manifest(self, step: int) -> tuple[layout.Manifest, bytes]:
        raise NotImplementedError

    def delete(self, step: int) -> int:
        raise NotImplementedError


def test_a_deep_read_of_a_file_claiming_2_55_bytes_plans_nothing_ahead_of_its_reads() -> None:
    entry = layout.FileEntry(size=1 << 55, checksum="crc32cx64k:00000000")
    manifest = layout.Manifest(1, 1, "periodic", 0.0, {"shard-00000.safetensors": entry}, 0)
    tier = _Claiming()
    problems = tier.read_files(1, "data-" + "0" * 24, manifest)
    assert [p.file for p in problems] == ["shard-00000.safetensors"]
    assert tier.reads <= 3 * tier.options.concurrency  # the chunks taken before the first failure was seen


def test_ftsup_ckpt_list_refuses_a_timeout_that_is_not_a_number_of_seconds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["ckpt", "list", os.fspath(tmp_path), "--timeout", "soon"])
    assert (code, "argument --timeout: 'soon' is not a number of seconds" in capsys.readouterr().err) == (2, True)
