"""Auto-instrumentation from the supervisor's side: on unless `--no-instrument` (`launch.instrument`), the ranks'
environment it gives (the start-up hook first on PYTHONPATH, the collective timeout), the collective timeout's rule
(`heartbeat.collective_timeout_s`), and the console line that says whether hangs are detected."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ftsup import protocol
from ftsup.supervisor.config import args as config_args
from ftsup.supervisor.config.args import Override
from ftsup.supervisor.errors import ConfigError
from ftsup.supervisor.run.instrument import hook_dir, rank_env
from ftsup.supervisor.telemetry import console


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def config(*overrides: tuple[str, str], flags: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    import argparse

    parser = argparse.ArgumentParser()
    config_args.add_arguments(parser)
    given = parser.parse_args(list(flags)).overrides or []
    given += [Override(key, value, "--set") for key, value in overrides]
    return config_args.load(None, given, ["python", "train.py"], hostname="node-a")


def test_ranks_are_instrumented_unless_no_instrument_is_given():
    assert (config().launch.instrument, config(flags=("--no-instrument",)).launch.instrument) == (True, False)


def test_no_instrument_and_the_key_given_together_are_refused_as_given_twice():
    with pytest.raises(ConfigError, match="given twice"):
        config(flags=("--no-instrument", "--launch-instrument", "true"))


def test_the_collective_timeout_is_a_minute_past_the_save_timeout_unless_set():
    shorter = config(("heartbeat.save_timeout_s", "100"))
    assert (config().heartbeat.collective_timeout, shorter.heartbeat.collective_timeout) == (960.0, 160.0)


def test_a_collective_timeout_no_longer_than_the_save_timeout_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"collective_timeout_s: 900 is not above heartbeat.save_timeout_s 900"):
        config(("heartbeat.collective_timeout_s", "900"))


def test_an_instrumented_rank_gets_the_hook_first_on_its_pythonpath_and_the_collective_timeout():
    got = rank_env(config(("heartbeat.collective_timeout_s", "1000")), {"PYTHONPATH": "/mine:/also"})
    assert got == {
        "PYTHONPATH": os.pathsep.join([str(hook_dir()), "/mine", "/also"]),
        protocol.COLLECTIVE_TIMEOUT_ENV: "1000.0",
    }


def test_a_rank_not_instrumented_gets_nothing_of_it():
    assert rank_env(config(flags=("--no-instrument",)), {"PYTHONPATH": "/mine"}) == {}


@pytest.mark.parametrize(
    ("instrument", "mode", "says"),
    [
        (True, "auto", "ranks auto-instrumented: hangs detected from each attempt's first optimizer step"),
        (False, "auto", "ranks not instrumented (--no-instrument): hang detection off until the script sends"),
        (True, "off", "hang detection off (heartbeat.mode: off)"),
        (False, "required", "hangs detected from launch on"),
    ],
)
def test_the_start_says_whether_the_ranks_are_instrumented_and_so_whether_hangs_are_detected(instrument, mode, says):
    event = {"event": "supervisor_started", "run_id": "r", "node_id": "n", "instrument": instrument}
    assert says in str(console.line({**event, "heartbeat_mode": mode}))
