"""`checkpoint.durable` in the job config (`config_durable`): absent or null is no tier, a location string is short for
`{url: ...}`, every key of the mapping has its default, every bad value is refused naming its key, and the ranks see
the tier (and the endpoint the config gives) in their environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup.protocol import DURABLE_TIER_ENV, FALLBACK_DIR_ENV, NODE_LOCAL_ENV
from ftsup.supervisor.config import args as config_args
from ftsup.supervisor.config.durable import DurableConfig
from ftsup.supervisor.config.job import JobConfig, parse_config
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.run import launcher


def config(durable: object = None, *, given: bool = True) -> JobConfig:
    checkpoint = {"dir": "/ckpt", "durable": durable} if given else {"dir": "/ckpt"}
    raw = {"job": {"command": ["true"]}, "checkpoint": checkpoint}
    return parse_config(raw, source="job.yaml", base_dir=Path("/job"), hostname="n")


def test_no_durable_key_and_a_null_one_are_no_tier() -> None:
    assert (config(given=False).checkpoint.durable, config(None).checkpoint.durable) == (None, None)


def test_a_location_string_is_a_tier_with_every_default() -> None:
    assert config("s3://my-bucket/jobs/gpt/").checkpoint.durable == DurableConfig(url="s3://my-bucket/jobs/gpt")


def test_the_keys_of_a_mapping_replace_their_defaults() -> None:
    section = {"url": "/shared/durable", "periodic_every": 0, "emergency": False, "keep_last": 5}
    section |= {"part_bytes": 8 << 20, "concurrency": 2, "hold_while_saving_s": 0}
    got = config(section).checkpoint.durable
    assert got == DurableConfig(
        url="/shared/durable",
        periodic_every=0,
        emergency=False,
        keep_last=5,
        part_bytes=8 << 20,
        concurrency=2,
        hold_while_saving_s=0.0,
    )


@pytest.mark.parametrize(
    ("durable", "message"),
    [
        ("relative/path", "checkpoint.durable.url: 'relative/path': a filesystem path must be absolute"),
        ("gs://bucket/x", "checkpoint.durable.url: 'gs://bucket/x': scheme 'gs' is not s3"),
        ("s3://B/x", "checkpoint.durable.url: 's3://B/x': bucket 'B' is not an S3 bucket name"),
        ("s3://bucket/a/../b", "checkpoint.durable.url: 's3://bucket/a/../b': prefix component '..'"),
        ("~/durable", "checkpoint.durable.url: '~/durable': neither '~' nor environment variables are expanded"),
        ({"periodic_every": 2}, "checkpoint.durable.url: required; give s3://BUCKET/PREFIX"),
        (
            {"url": "s3://bucket/x", "part_bytes": 6_000_000},
            "checkpoint.durable.part_bytes: 6000000 is not a multiple of 65536",
        ),
        ({"url": "s3://bucket/x", "part_bytes": 1 << 20}, "checkpoint.durable.part_bytes: must be at least 5242880"),
        ({"url": "s3://bucket/x", "concurrency": 0}, "checkpoint.durable.concurrency: must be at least 1"),
        ({"url": "s3://bucket/x", "keep_last": 0}, "checkpoint.durable.keep_last: must be at least 1"),
        (
            {"url": "s3://bucket/x", "hold_while_saving_s": -1},
            "checkpoint.durable.hold_while_saving_s: must be at least 0 seconds",
        ),
        (
            {"url": "s3://bucket/x", "hold_while_saving_s": "30s"},
            "checkpoint.durable.hold_while_saving_s: expected a number of seconds",
        ),
        (
            {"url": "s3://bucket/x", "endpoint_url": "localhost:9000"},
            "checkpoint.durable.endpoint_url: 'localhost:9000' is not an http(s) URL",
        ),
        (
            {"url": "/shared/x", "endpoint_url": "http://127.0.0.1:9000"},
            "checkpoint.durable.endpoint_url: an endpoint is for an s3:// tier",
        ),
        (
            {"url": "s3://bucket/x", "aws_secret_access_key": "k"},
            "checkpoint.durable.aws_secret_access_key: unknown key",
        ),
        (["s3://bucket/x"], "checkpoint.durable: expected a location such as s3://BUCKET/PREFIX or a mapping"),
    ],
)
def test_a_bad_durable_tier_is_refused_naming_the_key(durable: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        config(durable)
    assert f"job.yaml: {message}" in str(e.value)


def test_the_tier_is_a_flag_of_ftsup_run() -> None:
    overrides = [config_args.Override("checkpoint.durable", "s3://my-bucket/run", "--checkpoint-durable")]
    cfg = config_args.load(None, overrides, ["python", "train.py"], hostname="n")
    assert cfg.checkpoint.durable == DurableConfig(url="s3://my-bucket/run")


def test_the_ranks_see_the_tier_and_the_configured_endpoint() -> None:
    cfg = config({"url": "s3://my-bucket/run", "endpoint_url": "http://127.0.0.1:9000"})
    env = launcher.rank_env(cfg, Path("/run"), None, {"AWS_ENDPOINT_URL_S3": "http://elsewhere:1"})
    assert (env[DURABLE_TIER_ENV], env["AWS_ENDPOINT_URL_S3"]) == ("s3://my-bucket/run", "http://127.0.0.1:9000")


def test_without_a_tier_the_ranks_environment_is_unchanged() -> None:
    env = launcher.rank_env(config(given=False), Path("/run"), None, {})
    assert [k for k in env if k == DURABLE_TIER_ENV or k.startswith("AWS_")] == []


def multinode(checkpoint: dict[str, object]) -> JobConfig:
    raw = {"job": {"command": ["true"]}, "launch": {"nnodes": 2, "rdzv_endpoint": "n0:29400"}, "checkpoint": checkpoint}
    return parse_config(raw, source="job.yaml", base_dir=Path("/job"), hostname="n")


def test_a_checkpoint_dir_is_shared_by_default() -> None:
    assert config(None).checkpoint.dir_shared is True


def test_node_local_fast_tiers_of_a_multinode_job_without_a_durable_tier_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.dir_shared: is false and nnodes \(2\).*set checkpoint.durable"):
        multinode({"dir": "/local/ckpt", "dir_shared": False})


def test_node_local_fast_tiers_of_a_multinode_job_with_a_durable_tier_on_a_filesystem_are_refused() -> None:
    with pytest.raises(ConfigError, match="checkpoint.dir_shared: .*object storage"):
        multinode({"dir": "/local/ckpt", "dir_shared": False, "durable": "/shared/durable"})


def test_node_local_fast_tiers_with_an_s3_tier_need_no_shared_dir_and_the_ranks_are_told() -> None:
    cfg = multinode({"dir_shared": False, "durable": "s3://bucket/job"})
    assert cfg.checkpoint.dir_shared is False
    assert launcher.durable_env(cfg)[NODE_LOCAL_ENV] == "1"
    assert NODE_LOCAL_ENV not in launcher.durable_env(config("s3://bucket/job"))


def test_the_fallback_directory_is_a_key_of_the_tier_and_the_ranks_see_it() -> None:
    cfg = config({"url": "s3://bucket/job", "fallback_dir": "/dev/shm/ftsup-fallback/"})
    assert cfg.checkpoint.durable is not None and cfg.checkpoint.durable.fallback_dir == "/dev/shm/ftsup-fallback"
    assert launcher.durable_env(cfg)[FALLBACK_DIR_ENV] == "/dev/shm/ftsup-fallback"
    assert FALLBACK_DIR_ENV not in launcher.durable_env(config("s3://bucket/job"))


@pytest.mark.parametrize(
    ("durable", "message"),
    [
        ({"url": "s3://bucket/x", "fallback_dir": "spill"}, "fallback_dir: 'spill': write an absolute path"),
        (
            {"url": "s3://bucket/x", "fallback_dir": "/spill", "emergency": False},
            "fallback_dir: an emergency checkpoint written there is kept only once it is durable, and emergency is "
            "false; set emergency: true or remove fallback_dir",
        ),
        ({"url": "s3://bucket/x", "fallback_dir": "/ckpt"}, "fallback_dir: /ckpt overlaps checkpoint.dir (/ckpt)"),
        ({"url": "s3://bucket/x", "fallback_dir": "/ckpt/spill"}, "fallback_dir: /ckpt/spill overlaps checkpoint.dir"),
        ({"url": "s3://bucket/x", "fallback_dir": "/"}, "fallback_dir: / overlaps checkpoint.dir (/ckpt)"),
    ],
)
def test_a_bad_fallback_directory_is_refused_naming_the_key(durable: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        config(durable)
    assert f"job.yaml: checkpoint.durable.{message}" in str(e.value)
