"""`checkpoint.memory` in the job config: absent, null or false is no tier, true its defaults, a string its
directory, a mapping its keys; a bad value is refused naming the key; the ranks see it in their environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup import memtier
from ftsup.protocol import MEMORY_TIER_ENV, RuntimeEnv
from ftsup.supervisor.config.job import JobConfig, parse_config
from ftsup.supervisor.config.memory import MemoryConfig
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.run import launcher


def config(memory: object = None, *, given: bool = True) -> JobConfig:
    checkpoint = {"dir": "/ckpt", "memory": memory} if given else {"dir": "/ckpt"}
    raw = {"job": {"command": ["true"], "run_id": "gpt-7"}, "checkpoint": checkpoint}
    return parse_config(raw, source="job.yaml", base_dir=Path("/job"), hostname="n")


def test_no_memory_key_null_and_false_are_no_tier() -> None:
    got = [config(given=False), config(None), config(False)]
    assert [c.checkpoint.memory for c in got] == [None, None, None]


@pytest.mark.parametrize(
    ("memory", "want"),
    [
        (True, MemoryConfig()),
        ("/dev/shm/mine", MemoryConfig(dir="/dev/shm/mine")),
        ({"dir": "/dev/shm/mine", "keep_last": 2}, MemoryConfig(dir="/dev/shm/mine", keep_last=2)),
        ({"keep_last": 2}, MemoryConfig(keep_last=2)),
    ],
)
def test_true_a_directory_or_a_mapping_give_the_tier(memory: object, want: MemoryConfig) -> None:
    assert config(memory).checkpoint.memory == want


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ({"keep_last": 3}, "checkpoint.memory.keep_last"),
        ({"keep_last": 0}, "checkpoint.memory.keep_last"),
        ({"dirr": "/dev/shm/x"}, "dirr"),
        ("relative/dir", "absolute, normalised path"),
        ("/dev/shm/../etc", "absolute, normalised path"),
        (7, "expected true, a directory or a mapping"),
    ],
)
def test_a_bad_memory_tier_is_refused_naming_the_key(memory: object, message: str) -> None:
    with pytest.raises(ConfigError, match="checkpoint.memory") as e:
        config(memory)
    assert message in str(e.value)


def test_the_ranks_see_the_tier_with_the_run_ids_default_directory() -> None:
    env = launcher.rank_env(config({"keep_last": 2}), Path("/run"), None, {})
    want = memtier.MemoryTier("/dev/shm/ftsup-gpt-7", 2)
    assert (env[MEMORY_TIER_ENV], RuntimeEnv.from_environ(env).memory_tier) == ("2:/dev/shm/ftsup-gpt-7", want)


def test_without_a_tier_the_ranks_environment_has_none() -> None:
    assert MEMORY_TIER_ENV not in launcher.rank_env(config(given=False), Path("/run"), None, {})
