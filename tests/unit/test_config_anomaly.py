"""The `anomaly:` section of the job config (`config_anomaly`): every key optional with its default, every bad value
refused naming its key, every key a flag of `ftsup run`."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsup.supervisor.cli.commands import build_parser
from ftsup.supervisor.config import args as config_args
from ftsup.supervisor.config.job import AnomalyConfig, parse_config
from ftsup.supervisor.errors import ConfigError


def anomaly(**keys: object) -> AnomalyConfig:
    raw = {"job": {"command": ["true"]}, "anomaly": keys}
    return parse_config(raw, source="job.yaml", base_dir=Path("/job"), hostname="n").anomaly


def test_an_empty_section_is_every_default():
    assert anomaly() == AnomalyConfig()


def test_keys_given_replace_their_defaults():
    got = anomaly(loss_spike_factor=3, loss_patience_steps=8, enabled=False, rollback_window_s=60)
    assert (got.loss_spike_factor, got.loss_patience_steps, got.enabled, got.rollback_window_s) == (3.0, 8, False, 60.0)


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("loss_spike_factor", 1, "above 1"),
        ("loss_spike_factor", "2x", "a number"),
        ("loss_window_steps", 2, "at least 5"),
        ("loss_patience_steps", 0, "at least 1"),
        ("warmup_steps", -1, "at least 0"),
        ("straggler_ratio", 0.5, "above 1"),
        ("drift_ratio", float("inf"), "finite"),
        ("max_rollbacks", 1.5, "whole number"),
        ("enabled", "yes please", "true"),
        ("rollback_window_s", 0, "above 0"),
        ("loss_spike_factr", 2, "did you mean 'loss_spike_factor'"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(key: str, value: object, says: str):
    with pytest.raises(ConfigError, match=rf"job.yaml: anomaly\.\w+: .*{says}"):
        anomaly(**{key: value})


def test_every_key_is_a_flag_of_ftsup_run():
    flags = ["run", "--anomaly-loss-spike-factor", "4", "--set", "anomaly.max_rollbacks=9"]
    overrides = build_parser(["run"]).parse_args(flags).overrides
    cfg = config_args.load(None, overrides, ["true"], hostname="n")
    assert (cfg.anomaly.loss_spike_factor, cfg.anomaly.max_rollbacks) == (4.0, 9)
