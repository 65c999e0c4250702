"""`heartbeat.mode` in a config file, and the YAML words yes, no, on and off: a boolean to a boolean key, the word
as written to a key of strings (YAML 1.1 would make `mode: off` false)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.supervisor.config.job import HeartbeatMode, JobConfig, load_config
from ftsup.supervisor.errors import ConfigError


def load(tmp: Path, content: dict[str, Any] | str) -> JobConfig:
    path = tmp / "job.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return load_config(path, hostname="node-a")


def test_an_unquoted_off_is_the_heartbeat_mode_off(tmp_path: Path) -> None:
    assert load(tmp_path, "job: {command: [python]}\nheartbeat: {mode: off}\n").heartbeat.mode == HeartbeatMode.OFF


def test_an_unknown_heartbeat_mode_names_the_key_and_the_modes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, {"job": {"command": ["python"]}, "heartbeat": {"mode": "requird"}})
    assert str(info.value).endswith(
        "job.yaml: heartbeat.mode: 'requird' is not one of off, auto, required (did you mean 'required'?)"
    )


def test_a_boolean_key_still_reads_yes_as_true(tmp_path: Path) -> None:
    assert load(tmp_path, "job: {command: [python]}\ncheckpoint: {verify_deep: yes}\n").checkpoint.verify_deep is True


def test_an_unquoted_no_in_a_string_value_is_the_word_no(tmp_path: Path) -> None:
    assert load(tmp_path, "job: {command: [python], env: {COUNTRY: no}}\n").job.env == {"COUNTRY": "no"}


def test_a_config_written_back_as_yaml_reads_back_its_heartbeat_mode(tmp_path: Path) -> None:
    written = load(tmp_path, "job: {command: [python]}\nheartbeat: {mode: off}\n").to_dict()  # as ftsup.sbatch does
    del written["source"]
    assert load(tmp_path, yaml.safe_dump(written)).heartbeat.mode == HeartbeatMode.OFF
