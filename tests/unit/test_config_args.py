"""The job config from the command line (`ftsup.supervisor.config.args`), through the real CLI entry point in-process:
`ftsup config check` takes the same arguments as `ftsup run` and starts nothing.

Each test runs in a directory of its own, which is where a config without a YAML file puts its state and checkpoints;
`python` is found on PATH as this interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.supervisor.cli.commands import build_parser, main
from ftsup.supervisor.config import args as config_args
from ftsup.supervisor.config.args import Override


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}")
    return tmp_path


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["config", "check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def config_of(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = check(capsys, "--json", *argv)
    assert (code, err) == (0, ""), err
    parsed: dict[str, Any] = json.loads(out)
    return parsed


def every_key() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in config_args.sections().items() for f in dataclasses.fields(cls)]


# --------------------------------------------------------------------------- without a YAML file


def test_without_a_file_state_and_checkpoints_go_under_ftsup_in_the_current_directory(capsys, in_tmp: Path) -> None:
    cfg = config_of(capsys, "--launch-node-id", "n1", "--", "python", "train.py")
    where = (cfg["job"]["workdir"], cfg["job"]["state_dir"], cfg["checkpoint"]["dir"])
    assert where == (str(in_tmp), str(in_tmp / ".ftsup" / "n1"), str(in_tmp / ".ftsup" / "checkpoints"))


def test_without_a_file_one_rank_per_node_is_launched_as_under_torchrun(capsys) -> None:
    assert config_of(capsys, "--", "python", "train.py")["launch"]["nproc_per_node"] == 1


def test_a_script_given_without_an_interpreter_runs_under_python(capsys) -> None:
    assert config_of(capsys, "--", "train.py", "--steps", "3")["job"]["command"] == [
        "python",
        "train.py",
        "--steps",
        "3",
    ]


def test_a_module_given_with_dash_m_runs_under_python(capsys) -> None:
    assert config_of(capsys, "--", "-m", "pkg.train")["job"]["command"] == ["python", "-m", "pkg.train"]


def test_what_follows_the_double_dash_is_the_commands_never_ftsups_flags(capsys) -> None:
    cfg = config_of(capsys, "--", "python", "train.py", "--nproc-per-node", "5")
    assert (cfg["job"]["command"][-2:], cfg["launch"]["nproc_per_node"]) == (["--nproc-per-node", "5"], 1)


def test_the_same_command_from_the_same_directory_is_the_same_job(capsys, in_tmp: Path) -> None:
    first = config_of(capsys, "--", "python", "a.py")["job"]["run_id"]
    (in_tmp / "other").mkdir()
    os.chdir(in_tmp / "other")
    assert (config_of(capsys, "--", "python", "a.py")["job"]["run_id"] == first, first.startswith("ftsup-")) == (
        False,
        True,
    )
    os.chdir(in_tmp)
    assert config_of(capsys, "--", "python", "b.py", "--more")["job"]["run_id"] == first


def test_without_a_file_or_a_command_it_says_what_to_give(capsys) -> None:
    code, _, err = check(capsys, "--nproc-per-node", "2")
    assert (code, err.splitlines()) == (
        2,
        [
            "ftsup: error: give the training command after --, e.g. ftsup run -- python train.py, or a job config "
            "(ftsup run --config JOB.yaml)"
        ],
    )


def test_nothing_after_the_double_dash_is_a_usage_error(capsys) -> None:
    code, _, err = check(capsys, "--")
    assert (code, "nothing follows --" in err) == (2, True)


# --------------------------------------------------------------------------- flags


def test_every_key_of_the_config_has_a_flag_that_sets_it() -> None:
    parser = build_parser(["run"])
    wrong = []
    for key in every_key():
        flag = config_args.flag(key)
        got = parser.parse_args(["run", flag, "x"]).overrides
        if got != [Override(key, "x", flag)]:
            wrong.append((key, got))
    assert (wrong, len(every_key()) > 40) == ([], True)


@pytest.mark.parametrize(
    ("flag", "key"),
    [
        ("--nproc-per-node", "launch.nproc_per_node"),
        ("--nnodes", "launch.nnodes"),
        ("--rdzv-endpoint", "launch.rdzv_endpoint"),
        ("--rdzv-id", "launch.rdzv_id"),
        ("--max-restarts", "restart.max_restarts"),
    ],
)
def test_torchruns_flag_names_set_their_keys(flag: str, key: str) -> None:
    assert build_parser(["run"]).parse_args(["run", flag, "2"]).overrides == [Override(key, "2", flag)]


def test_a_flag_overrides_the_files_key(capsys, in_tmp: Path) -> None:
    job = in_tmp / "job.yaml"
    job.write_text(yaml.safe_dump({"job": {"command": ["python", "t.py"]}, "heartbeat": {"timeout_s": 30}}))
    cfg = config_of(capsys, str(job), "--heartbeat-timeout-s", "60", "--set", "restart.max_restarts=4")
    assert (cfg["heartbeat"]["timeout_s"], cfg["restart"]["max_restarts"], cfg["job"]["command"]) == (
        60.0,
        4,
        ["python", "t.py"],
    )


def test_the_command_after_the_double_dash_replaces_the_files(capsys, in_tmp: Path) -> None:
    job = in_tmp / "job.yaml"
    job.write_text(yaml.safe_dump({"job": {"command": ["python", "t.py"]}}))
    assert config_of(capsys, str(job), "--", "python", "u.py")["job"]["command"] == ["python", "u.py"]


def test_values_are_read_as_yaml_by_the_files_rules(capsys) -> None:
    flags = ["--set", "launch.nnodes=1:2", "--rdzv-endpoint", "n0:29400", "--set", "eviction.signals=[usr1]"]
    flags += ["--checkpoint-dir", "/shared/ckpt", "--heartbeat-mode", "off"]
    cfg = config_of(capsys, *flags, "--", "python", "t.py")
    got = (cfg["launch"]["nnodes"], cfg["eviction"]["signals"], cfg["checkpoint"]["dir"], cfg["heartbeat"]["mode"])
    assert got == ("1:2", ["SIGUSR1"], "/shared/ckpt", "off")


def test_a_bad_value_is_one_line_naming_the_flag_and_the_key(capsys) -> None:
    code, out, err = check(capsys, "--heartbeat-startup-timeout-s", "0", "--", "python", "t.py")
    assert (code, out, err) == (
        2,
        "",
        "ftsup: error: --heartbeat-startup-timeout-s: heartbeat.startup_timeout_s: must be above 0 seconds, got 0\n",
    )


def test_a_bad_set_value_names_set_and_the_key(capsys) -> None:
    code, _, err = check(capsys, "--set", "heartbeat.mode=requird", "--", "python", "t.py")
    assert (code, err) == (
        2,
        "ftsup: error: --set: heartbeat.mode: 'requird' is not one of off, auto, required (did you mean 'required'?)\n",
    )


def test_an_unknown_key_in_set_is_named_with_what_it_may_mean(capsys) -> None:
    code, _, err = check(capsys, "--set", "restart.max_restart=3", "--", "python", "t.py")
    assert (code, err) == (2, "ftsup: error: --set: restart.max_restart: unknown key (did you mean 'max_restarts'?)\n")


def test_a_set_without_section_key_and_value_is_refused(capsys) -> None:
    code, _, err = check(capsys, "--set", "max_restarts", "--", "python", "t.py")
    assert (code, "expected SECTION.KEY=VALUE" in err, len(err.splitlines())) == (2, True, 1)


def test_a_key_given_twice_on_the_command_line_is_refused(capsys) -> None:
    code, _, err = check(capsys, "--nproc-per-node", "2", "--set", "launch.nproc_per_node=4", "--", "python", "t.py")
    assert (code, err) == (
        2,
        "ftsup: error: --set: launch.nproc_per_node: given twice on the command line (first by --nproc-per-node); "
        "keep one\n",
    )


def test_an_abbreviated_flag_is_not_taken_for_a_key(capsys) -> None:
    code, _, err = check(capsys, "--nproc", "2", "--", "python", "t.py")
    assert (code, "unrecognized arguments: --nproc" in err) == (2, True)


def test_a_command_that_is_not_on_path_is_refused_before_anything_starts(capsys, in_tmp: Path) -> None:
    code, _, err = check(capsys, "--", "no-such-program-ftsup", "x")
    assert (code, "job.command[0]" in err, list(in_tmp.iterdir())) == (2, True, [])
