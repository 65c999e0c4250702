"""Every kind of bad config is refused by `ftsup run` before anything starts: exit 2 and exactly one line on stderr,
naming the key (or, for a file that is not a config at all, the file).

One table, run through the real CLI entry point (`ftsup.supervisor.cli.main`, in-process), and a few rows again through
a real `ftsup` process. Each row builds its config in a fresh directory; `good()` is a config that would start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.supervisor.cli.commands import main
from tests.procs import PYTHONPATH, REPO


def good(tmp: Path) -> dict[str, Any]:
    """A config that passes every check (its command would run)."""
    return {
        "job": {"command": [sys.executable, "-c", "pass"], "workdir": str(tmp), "state_dir": str(tmp / "state")},
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }


def with_(section: str, key: str, value: object) -> Callable[[Path], dict[str, Any]]:
    def build(tmp: Path) -> dict[str, Any]:
        cfg = good(tmp)
        cfg.setdefault(section, {})[key] = value(tmp) if callable(value) else value
        return cfg

    return build


def text(body: str) -> Callable[[Path], str]:
    """A config written as raw YAML text; `{ok}` is replaced by the good config's job and checkpoint sections."""
    return lambda tmp: body.replace("{ok}", yaml.safe_dump({k: good(tmp)[k] for k in ("job", "checkpoint")}))


@dataclass(frozen=True)
class Case:
    kind: str
    config: Callable[[Path], Any]  # -> dict (dumped as YAML), str (written as is) or Path (used as the config)
    names: str  # what the one line must name: a key path, or "<file>" for the config file itself


def _file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("x")
    return tmp / "a-file"


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "job.yaml")
    return tmp / "job.yaml"


def _symlink_to_fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "fifo")
    (tmp / "job.yaml").symlink_to(tmp / "fifo")
    return tmp / "job.yaml"


def _directory(tmp: Path) -> Path:
    (tmp / "job.yaml").mkdir()
    return tmp / "job.yaml"


def _huge(tmp: Path) -> Path:
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(good(tmp)) + "#" * 1000 + ("\n" + "#" * 1000) * 300)
    return path


def _not_utf8(tmp: Path) -> Path:
    path = tmp / "job.yaml"
    path.write_bytes(yaml.safe_dump(good(tmp)).encode() + b"# caf\xe9\n")
    return path


def _script(tmp: Path, mode: int) -> str:
    (tmp / "train.sh").write_text("#!/bin/sh\n")
    (tmp / "train.sh").chmod(mode)
    return "./train.sh"


BOMB = (
    "{ok}"
    + "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(
        f"{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, n in zip("abcdefgh", "bcdefghi", strict=True)
    )
)

CASES = [
    # wrong types
    Case("quoted integer", with_("restart", "max_restarts", "10"), "restart.max_restarts"),
    Case("boolean for an integer", with_("launch", "min_world_size", True), "launch.min_world_size"),
    Case("float for an integer", with_("launch", "nproc_per_node", 2.5), "launch.nproc_per_node"),
    Case("string for a boolean", with_("checkpoint", "verify_deep", "yes"), "checkpoint.verify_deep"),
    Case("string for a duration", with_("heartbeat", "interval_s", "1s"), "heartbeat.interval_s"),
    Case("command as one string", with_("job", "command", "python train.py"), "job.command"),
    Case("number in the command", with_("job", "command", ["python", 200]), "job.command[1]"),
    Case("number in env", with_("job", "env", {"SEED": 1}), "job.env.SEED"),
    Case("bad env name", with_("job", "env", {"A-B": "1"}), "job.env"),
    Case("number for host:port", with_("metrics", "listen", 9400), "metrics.listen"),
    Case("section as a list", text("{ok}launch: [1, 2]\n"), "launch"),
    Case("top level a list", text("- job\n"), "<file>"),
    Case("non-string key", text("{ok}restart: {1: 2}\n"), "restart"),
    Case("null for a key with a default", text("{ok}restart: {window_s: null}\n"), "restart.window_s"),
    Case("missing required key", text("checkpoint: {dir: ckpt}\n"), "job.command"),
    Case(
        "no shared store for nodes",
        text("job: {command: [python]}\nlaunch: {nnodes: 2, rdzv_endpoint: 'n:1'}\n"),
        "checkpoint.dir",
    ),
    # durations and bounds
    Case("negative duration", with_("restart", "window_s", -5), "restart.window_s"),
    Case("zero duration", with_("heartbeat", "startup_timeout_s", 0), "heartbeat.startup_timeout_s"),
    Case("infinite duration", text("{ok}heartbeat: {save_timeout_s: .inf}\n"), "heartbeat.save_timeout_s"),
    Case("huge duration", with_("eviction", "poll_interval_s", 1e300), "eviction.poll_interval_s"),
    Case("400-digit integer", text("{ok}restart: {max_restarts: " + "9" * 400 + "}\n"), "restart.max_restarts"),
    Case("5000-digit integer", text("{ok}restart: {max_restarts: " + "9" * 5000 + "}\n"), "<file>"),
    Case("huge node range", with_("launch", "nnodes", "1:1000000000"), "launch.nnodes"),
    Case("huge nproc", with_("launch", "nproc_per_node", 100_000), "launch.nproc_per_node"),
    Case("long run_id", with_("job", "run_id", "r" * 100), "job.run_id"),
    Case("run_id with a slash", with_("job", "run_id", "../etc"), "job.run_id"),
    Case("too many arguments", with_("job", "command", ["python"] + ["-v"] * 2000), "job.command"),
    Case("huge argument", with_("job", "command", ["python", "x" * 40_000]), "job.command[1]"),
    Case("NUL in an argument", with_("job", "command", ["python", "a\0b"]), "job.command[1]"),
    Case("NUL in env", with_("job", "env", {"A": "a\0b"}), "job.env.A"),
    Case("huge string", with_("eviction", "endpoint", "http://" + "h" * 5000), "eviction.endpoint"),
    Case("multiplier too large", with_("heartbeat", "step_time_multiplier", 1e9), "heartbeat.step_time_multiplier"),
    # rules between keys
    Case("min above max world size", with_("launch", "min_world_size", 3), "launch.min_world_size"),
    Case(
        "indivisible global batch",
        lambda tmp: good(tmp) | {"launch": {"nproc_per_node": 4, "min_world_size": 2, "global_batch": 7}},
        "launch.global_batch",
    ),
    Case("timeout not above interval", with_("heartbeat", "timeout_s", 0.5), "heartbeat.timeout_s"),
    Case("torchrun flag ftsup sets", with_("launch", "torchrun_args", ["--nnodes=2"]), "launch.torchrun_args[0]"),
    Case("host without port", with_("metrics", "listen", "0.0.0.0"), "metrics.listen"),
    Case("endpoint not a URL", with_("eviction", "endpoint", "127.0.0.1:8080"), "eviction.endpoint"),
    Case("bad choice", with_("logging", "level", "warn"), "logging.level"),
    Case("multi-node without endpoint", with_("launch", "nnodes", "1:2"), "launch.rdzv_endpoint"),
    # YAML itself
    Case("YAML bomb (billion laughs)", text(BOMB), "<file>"),
    Case("deep nesting (lists)", text("{ok}restart: " + "[" * 5000 + "]" * 5000 + "\n"), "<file>"),
    Case("deep nesting (mappings)", text("{ok}restart: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"), "<file>"),
    Case("duplicate key", text("{ok}restart: {window_s: 1, window_s: 2}\n"), "<file>"),
    Case("syntax error", text("job:\n  command: [python, train.py\n"), "<file>"),
    Case("empty file", text("# nothing\n"), "<file>"),
    # unknown keys at every level
    Case("unknown section", text("{ok}heartbeats: {}\n"), "heartbeats"),
    *(
        Case(f"unknown key in {section}", with_(section, "zzz_unknown", 1), f"{section}.zzz_unknown")
        for section in ("job", "launch", "checkpoint", "heartbeat", "restart", "eviction", "metrics", "logging")
    ),
    # signals
    Case("SIGCHLD as a notice", with_("eviction", "signals", ["SIGCHLD"]), "eviction.signals[0]"),
    Case("SIGKILL as a notice", with_("eviction", "signals", ["SIGTERM", "KILL"]), "eviction.signals[1]"),
    Case("SIGWINCH as a notice", with_("eviction", "signals", ["WINCH"]), "eviction.signals[0]"),
    Case("SIGINT as a notice", with_("eviction", "signals", ["SIGTERM", "SIGINT"]), "eviction.signals[1]"),
    Case("SIGPIPE as a notice", with_("eviction", "signals", ["pipe"]), "eviction.signals[0]"),
    Case("alias of a refused signal", with_("eviction", "signals", ["SIGCLD"]), "eviction.signals[0]"),
    Case("unknown signal", with_("eviction", "signals", ["SIGUSER1"]), "eviction.signals[0]"),
    Case("signal number", with_("eviction", "signals", [15]), "eviction.signals[0]"),
    # the file itself
    Case("missing file", lambda tmp: tmp / "nowhere.yaml", "<file>"),
    Case("directory", _directory, "<file>"),
    Case("FIFO", _fifo, "<file>"),
    Case("symlink to a FIFO", _symlink_to_fifo, "<file>"),
    Case("/dev/zero", lambda tmp: Path("/dev/zero"), "<file>"),
    Case("huge file", _huge, "<file>"),
    Case("non-UTF-8", _not_utf8, "<file>"),
    # paths and the command, as this host sees them
    Case("home-relative path", with_("checkpoint", "dir", "~/ckpt"), "checkpoint.dir"),
    Case("variable in a path", with_("checkpoint", "dir", "${SCRATCH}/ckpt"), "checkpoint.dir"),
    Case("missing workdir", with_("job", "workdir", lambda tmp: str(tmp / "no" / "such")), "job.workdir"),
    Case("workdir is a file", with_("job", "workdir", lambda tmp: str(_file(tmp))), "job.workdir"),
    Case("checkpoint.dir is a file", with_("checkpoint", "dir", lambda tmp: str(_file(tmp))), "checkpoint.dir"),
    Case("checkpoint.dir under a file", with_("checkpoint", "dir", lambda tmp: f"{_file(tmp)}/ck"), "checkpoint.dir"),
    Case("state_dir is a file", with_("job", "state_dir", lambda tmp: str(_file(tmp))), "job.state_dir"),
    Case("logging.dir is a file", with_("logging", "dir", lambda tmp: str(_file(tmp))), "logging.dir"),
    Case("command not found", with_("job", "command", ["no-such-program-ftsup", "x"]), "job.command[0]"),
    Case("command is a directory", with_("job", "command", ["./"]), "job.command[0]"),
    Case("command not executable", with_("job", "command", lambda tmp: [_script(tmp, 0o644)]), "job.command[0]"),
    Case(
        "PATH in job.env hides it",
        lambda tmp: (
            good(tmp) | {"job": good(tmp)["job"] | {"command": ["sh", "train.sh"], "env": {"PATH": str(tmp / "empty")}}}
        ),
        "job.command[0]",
    ),
]


def write_config(tmp: Path, case: Case) -> Path:
    made = case.config(tmp)
    if isinstance(made, Path):
        return made
    path = tmp / "job.yaml"
    path.write_text(made if isinstance(made, str) else yaml.safe_dump(made))
    return path


def expected_name(case: Case, config: Path) -> str:
    return str(config) if case.names == "<file>" else case.names


def test_the_good_config_passes_every_check(tmp_path: Path) -> None:
    from ftsup.supervisor.config.job import load_config
    from ftsup.supervisor.run import preflight

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(good(tmp_path)))
    preflight.check(load_config(config))  # raises if any check refuses it


def test_every_kind_of_bad_config_is_a_different_case() -> None:
    assert len({c.kind for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_a_bad_config_exits_2_with_one_line_naming_the_key_or_file(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, case)
    code = main(["run", "--config", str(config)])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert (code, out, len(lines), lines[0].startswith("ftsup: error: "), expected_name(case, config) in err) == (
        2,
        "",
        1,
        True,
        True,
    ), err[-2000:]
    assert not (tmp_path / "state").exists()  # nothing started: not even the state directory


THROUGH_A_PROCESS = [
    "FIFO",
    "/dev/zero",
    "deep nesting (lists)",
    "YAML bomb (billion laughs)",
    "missing workdir",
    "command not found",
    "SIGCHLD as a notice",
]


@pytest.mark.parametrize("kind", THROUGH_A_PROCESS)
def test_a_bad_config_exits_2_with_one_line_from_a_real_ftsup_process(kind: str, tmp_path: Path) -> None:
    case = next(c for c in CASES if c.kind == kind)
    config = write_config(tmp_path, case)
    r = subprocess.run(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=PYTHONPATH),
    )
    lines = r.stderr.splitlines()
    assert (r.returncode, r.stdout, len(lines), expected_name(case, config) in r.stderr) == (2, "", 1, True), r.stderr


def test_a_config_reached_through_a_symlink_is_read(tmp_path: Path) -> None:
    from ftsup.supervisor.config.job import load_config

    (tmp_path / "real.yaml").write_text(yaml.safe_dump(good(tmp_path)))
    (tmp_path / "job.yaml").symlink_to(tmp_path / "real.yaml")
    assert load_config(tmp_path / "job.yaml").checkpoint.dir == tmp_path / "ckpt"


def test_config_check_accepts_what_ftsup_run_would_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(good(tmp_path)))
    code = main(["config", "check", str(config)])
    out, err = capsys.readouterr()
    assert (code, out.startswith(f"{config}: ok"), err) == (0, True, "")


def test_config_check_refuses_what_ftsup_run_would_refuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = next(c for c in CASES if c.kind == "missing workdir")
    code = main(["config", "check", str(write_config(tmp_path, case))])
    _, err = capsys.readouterr()
    assert (code, len(err.splitlines()), "job.workdir" in err) == (2, 1, True)
