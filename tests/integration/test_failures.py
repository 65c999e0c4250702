"""Failures explained where the operator looks: `ftsup run` of real torchrun jobs (tests/bin/failing_rank.py) whose
rank exits with a traceback, is SIGKILLed or SIGSEGVs, cannot import a module, or runs under an interpreter without
torch; the failure events, the crash-loop exit, the journal, the console and `ftsup status` say why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import BIN, PYTHONPATH, kill_tree, run, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]


def write_job(tmp: Path, *command: str, nproc: int = 2, **sections: Any) -> Path:
    cfg: dict[str, Any] = {
        "job": {
            "command": list(command),
            "workdir": str(tmp),
            "state_dir": str(tmp / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": nproc},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "restart": {"backoff_initial_s": 0.1, "stop_grace_s": 3, "max_attempts_without_progress": 1},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def failing(tmp: Path, mode: str, *args: str, **sections: Any) -> Path:
    return write_job(tmp, sys.executable, str(BIN / "failing_rank.py"), mode, *args, **sections)


def ftsup(*args: str, timeout: float = 120):
    return run([sys.executable, "-m", "ftsup.supervisor.cli", *args], timeout=timeout)


def events(tmp: Path, name: str) -> list[dict[str, Any]]:
    lines = (tmp / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


@pytest.mark.parametrize(
    ("mode", "exit_code", "signal", "last_line"),
    [
        ("exit", 1, None, "ValueError: boom at step 3"),
        ("kill", -9, "SIGKILL", "err 2"),
        ("segv", -11, "SIGSEGV", "in <module>"),  # the end of faulthandler's stack, innermost frame first
    ],
    ids=["exit 1 with a traceback", "SIGKILL", "SIGSEGV"],
)
def test_a_failed_rank_is_named_with_its_exit_code_or_signal_and_its_last_lines(
    tmp_path, mode, exit_code, signal, last_line
) -> None:
    r = ftsup("run", "--config", str(failing(tmp_path, mode)))
    assert r.returncode == 3, r.output[-3000:]
    (ev,) = events(tmp_path, "worker_exited")
    log = tmp_path / "state" / "logs" / "attempt-0001.log"
    assert (ev["rank"], ev["exit_code"], ev["signal"], ev["log"], log.is_file()) == (
        1,
        exit_code,
        signal,
        str(log),
        True,
    )
    assert ev["output"][-1].endswith(last_line), ev["output"]
    assert ev["reason"].startswith(f"rank 1 (pid {ev['failures'][0]['pid']}) ")


def test_a_segfault_shows_the_python_stack_of_the_rank_that_crashed(tmp_path) -> None:
    ftsup("run", "--config", str(failing(tmp_path, "segv")))
    (ev,) = events(tmp_path, "worker_exited")
    assert "Fatal Python error: Segmentation fault" in ev["output"]


@pytest.fixture(scope="module")
def crash_loop(tmp_path_factory) -> tuple[Path, Any]:
    tmp = tmp_path_factory.mktemp("loop")
    job = failing(tmp, "exit", restart={"max_attempts_without_progress": 2}, logging={"format": "console"})
    return tmp, ftsup("run", "--config", str(job))


def test_the_crash_loop_exit_repeats_the_cause_of_the_last_failure(crash_loop) -> None:
    tmp, r = crash_loop
    (ev,) = events(tmp, "crash_loop_detected")
    assert r.returncode == 3 and "2 attempts in a row" in ev["reason"]
    assert "rank 1" in ev["reason"] and "exited with code 1: ValueError: boom at step 3" in ev["reason"]
    assert ev["log"] == str(tmp / "state" / "logs" / "attempt-0002.log")


def test_the_journals_last_failure_is_the_crash_loops_cause(crash_loop) -> None:
    tmp, _ = crash_loop
    (ev,) = events(tmp, "crash_loop_detected")
    assert json.loads((tmp / "state" / "journal.json").read_text())["last_failure"] == ev["reason"]


def test_the_console_shows_each_launch_failure_relaunch_and_the_end_in_short_lines(crash_loop) -> None:
    _, r = crash_loop
    lines = [line for line in r.output.splitlines() if line.startswith("ftsup: ")]
    expected = [
        "supervising ",
        "ranks auto-instrumented: hangs detected from each attempt's first optimizer step",
        "attempt 1 launched: 2 rank(s), from scratch",
        "attempt 1 failed: rank 1 (pid ",
        "relaunching in ",
        "attempt 2 launched",
        "attempt 2 failed: rank 1 (pid ",
        "giving up: crash loop",
        "exit status 3",
    ]
    assert len(lines) == len(expected) and all(
        line.startswith(f"ftsup: {e}") for line, e in zip(lines, expected, strict=True)
    )
    assert "    | ValueError: boom at step 3" in r.output.splitlines()
    assert not any(line.startswith("{") for line in r.output.splitlines())  # no JSON on stderr


def test_a_rank_that_beats_and_is_sigkilled_is_named_with_its_signal(tmp_path) -> None:
    r = ftsup("run", "--config", str(failing(tmp_path, "kill", "--beat", "--after-s", "1.5")))
    assert r.returncode == 3, r.output[-3000:]
    told = [(ev["rank"], ev["signal"]) for ev in events(tmp_path, "worker_exited")]
    assert told and set(told) == {(1, "SIGKILL")}, told  # every attempt: it beat, so it made progress once


def test_a_module_that_cannot_be_imported_at_start_up_ends_the_job_at_once_saying_so(tmp_path) -> None:
    r = ftsup("run", "--config", str(failing(tmp_path, "import", restart={"max_attempts_without_progress": 5})))
    (ev,) = events(tmp_path, "crash_loop_detected")
    assert r.returncode == 3 and len(events(tmp_path, "workers_launched")) == 1
    assert "cannot start: rank 1: ModuleNotFoundError: No module named 'ftsup_no_such_module'" in ev["reason"]


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> Path:
    """A real interpreter that cannot import torch: a virtual environment without packages."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    assert subprocess.run([python, "-c", "import torch"], capture_output=True, timeout=60).returncode != 0
    return python


def test_an_interpreter_without_torch_is_refused_in_one_line_before_anything_starts(tmp_path, no_torch) -> None:
    job = write_job(tmp_path, str(no_torch), str(BIN / "failing_rank.py"), "exit")
    r = ftsup("run", "--config", str(job))
    lines = r.output.strip().splitlines()
    assert (r.returncode, len(lines), (tmp_path / "state").exists()) == (2, 1, False), r.output
    assert "job.command[0]" in lines[0] and f"'{no_torch}' cannot import torch" in lines[0]


def test_a_bare_python_is_the_interpreter_ftsup_runs_under_whatever_path_finds_first(tmp_path, no_torch) -> None:
    first = tmp_path / "bin"
    first.mkdir()
    (first / "python").symlink_to(no_torch)  # what PATH finds first has no torch
    out = tmp_path / "executable"
    code = f"import os, sys; open({str(out)!r} + os.environ['RANK'], 'w').write(sys.executable)"
    job = write_job(tmp_path, "python", "-c", code, nproc=1, job={"env": {"PATH": f"{first}:{os.environ['PATH']}"}})
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 0, r.output[-3000:]
    assert Path(str(out) + "0").read_text() == sys.executable


def test_status_shows_a_running_jobs_ranks_and_then_that_no_supervisor_runs(tmp_path) -> None:
    until = tmp_path / "until"
    job = write_job(
        tmp_path, sys.executable, str(BIN / "beater.py"), "--steps", "1", "--step-s", "0.05", "--until", str(until)
    )
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def heard() -> dict[str, Any] | None:
            got = json.loads(ftsup("status", "--config", str(job), "--json").output)
            return got if len(got["ranks"]) == 2 and min(r["step"] for r in got["ranks"]) > 3 else None

        got = wait_for(heard, 60, "status never showed both ranks training")
        assert got["supervisor_running"] is True and {r["phase"] for r in got["ranks"]} == {"train"}
        assert all(r["loss"] is not None and 0 <= r["heartbeat_age_s"] < 10 for r in got["ranks"])
        until.write_text("")
        assert proc.wait(timeout=60) == 0
    finally:
        kill_tree(proc.pid)
    text = ftsup("status", "--config", str(job)).output
    assert "supervisor not running (it ended: succeeded" in text and "metrics" not in text
