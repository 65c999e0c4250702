"""`ftsup status` with `checkpoint.durable`: the tier's newest durable checkpoint, what waits and the last error, as
the supervisor last journaled them (hostile input: a field of the wrong type is shown as unknown)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.supervisor.cli.commands import main
from ftsup.supervisor.state.journal import Journal, JournalRecord


def job(tmp: Path, durable: object) -> Path:
    (tmp / "state").mkdir(mode=0o700)
    config = tmp / "job.yaml"
    raw = {
        "job": {"command": ["true"], "state_dir": str(tmp / "state"), "run_id": "r"},
        "checkpoint": {"dir": str(tmp / "ckpt"), "durable": durable},
    }
    config.write_text(yaml.safe_dump(raw))
    return config


def journal(tmp: Path, extra: dict[str, Any]) -> None:
    record = JournalRecord(
        run_id="r", node_id="n", supervisor_pid=os.getpid(), status="running", updated_unix=time.time(), extra=extra
    )
    Journal(tmp / "state" / "journal.json").write(record)


def status(config: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["status", "--config", str(config), *flags]) == 0
    return capsys.readouterr().out


def test_status_shows_the_newest_durable_checkpoint_what_waits_and_the_last_error(tmp_path, capsys) -> None:
    config = job(tmp_path, "s3://my-bucket/run")
    tier = {"url": "s3://my-bucket/run", "newest_step": 40, "newest_unix": 0, "pending": [60], "uploading": 50}
    journal(tmp_path, {"durable": {**tier, "last_error": "the store is down"}})
    shown = json.loads(status(config, capsys, "--json"))["durable"]
    text = status(config, capsys)
    assert shown == {
        "url": "s3://my-bucket/run",
        "newest_step": 40,
        "newest_unix": 0.0,
        "pending": [60],
        "uploading": 50,
        "last_error": "the store is down",
    }
    assert (
        "durable tier s3://my-bucket/run: newest durable checkpoint step 40 (1970-01-01 00:00:00 UTC); "
        "uploading step 50, waiting: step 60; last error: the store is down"
    ) in text


def test_a_journaled_tier_of_the_wrong_shape_shows_as_unknown(tmp_path, capsys) -> None:
    config = job(tmp_path, "s3://my-bucket/run")
    tier = {"url": "s3://my-bucket/run", "newest_step": "40", "pending": [True, -1, 7], "uploading": 1.5}
    journal(tmp_path, {"durable": {**tier, "last_error": ["x"]}})
    shown = json.loads(status(config, capsys, "--json"))["durable"]
    assert shown == {
        "url": "s3://my-bucket/run",
        "newest_step": None,
        "newest_unix": None,
        "pending": [7],
        "uploading": None,
        "last_error": None,
    }


def test_a_journaled_time_no_clock_can_show_is_unknown_and_status_still_prints(tmp_path, capsys) -> None:
    config = job(tmp_path, "s3://my-bucket/run")
    journal(tmp_path, {"durable": {"url": "s3://my-bucket/run", "newest_step": 40, "newest_unix": 1e20}})
    assert json.loads(status(config, capsys, "--json"))["durable"]["newest_unix"] is None
    assert "newest durable checkpoint step 40" in status(config, capsys)


def test_without_a_tier_status_has_a_null_durable(tmp_path, capsys) -> None:
    config = job(tmp_path, None)
    journal(tmp_path, {})
    assert json.loads(status(config, capsys, "--json"))["durable"] is None
    assert "durable" not in status(config, capsys)
