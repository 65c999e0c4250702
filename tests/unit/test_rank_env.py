"""The environment torchrun and the ranks start with (`run.launcher.rank_env`): ftsup's defaults, and the values the
supervisor's environment or `job.env` give instead."""

from __future__ import annotations

from pathlib import Path

from ftsup.supervisor.config.job import JobConfig, parse_config
from ftsup.supervisor.run import launcher

STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def config(env: dict[str, str] | None = None) -> JobConfig:
    raw = {"job": {"command": ["true"], "run_id": "gpt-7", "env": env or {}}, "checkpoint": {"dir": "/ckpt"}}
    return parse_config(raw, source="job.yaml", base_dir=Path("/job"), hostname="n")


def test_the_workers_bootstrap_from_a_store_of_their_own_and_print_their_stack_on_a_crash_by_default() -> None:
    env = launcher.rank_env(config(), Path("/run"), None, {"PATH": "/bin"})
    assert (env[STORE], env["PYTHONFAULTHANDLER"], env["PATH"]) == ("1", "1", "/bin")


def test_a_value_from_the_supervisors_environment_or_the_job_stays() -> None:
    outside = launcher.rank_env(config(), Path("/run"), None, {STORE: "0", "PYTHONFAULTHANDLER": ""})
    job = launcher.rank_env(config({STORE: "0"}), Path("/run"), None, {})
    assert (outside[STORE], outside["PYTHONFAULTHANDLER"], job[STORE]) == ("0", "", "0")
