"""The reference trainer on a store that refuses writes: a failed periodic save is logged and
training goes on; a failed emergency save is logged and the run stops with the last committed
checkpoint as the resume point, and under `ftsup run` the eviction exits 8 naming the steps lost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftsup.protocol import Request, encode_control
from ftsup.store import layout
from tests.procs import PYTHONPATH, run

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--corpus-bytes", "50000"]
SMALL += ["--ckpt-every", "2"]


def gpt(ckpt: Path, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return run(
        [sys.executable, "-m", "ftsup.trainer.examples.gpt", *SMALL, "--ckpt-dir", str(ckpt), *args],
        timeout=120,
        env=env,
    )


@pytest.fixture
def read_only_store(tmp_path: Path) -> Iterator[Path]:
    """A store holding step 2 of an 8-step run, on a filesystem then remounted read-only."""
    import os

    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a filesystem needs root")
    try:
        first = gpt(mnt / "ckpt", "--steps", "8", "--fault", "exit@3")
        assert first.returncode == 3, first.output[-3000:]
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)]).returncode == 0
        yield mnt / "ckpt"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def logged_steps(path: Path) -> list[int]:
    """Steps in the loss log (a line being written, not yet ended, is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["step"] for line in text.split("\n")[:-1]]


def test_failed_periodic_saves_are_logged_and_training_goes_on(read_only_store: Path, tmp_path: Path) -> None:
    r = gpt(read_only_store, "--steps", "8", "--loss-log", str(tmp_path / "loss.jsonl"))
    assert logged_steps(tmp_path / "loss.jsonl") == [3, 4, 5, 6, 7, 8], r.output[-3000:]
    failed = [line for line in r.output.splitlines() if "checkpoint_save_failed" in line]
    assert [re.search(r"\bstep=(\d+)", line).group(1) for line in failed] == ["4", "6", "8"]  # type: ignore[union-attr]
    assert r.returncode == 1 and "gpt: error:" in r.output  # the final checkpoint could not be saved
    info = layout.latest_consistent(read_only_store, deep=True)
    assert info is not None and info.step == 2


def test_a_failed_emergency_save_is_logged_and_the_run_stops_at_the_last_checkpoint(
    read_only_store: Path, tmp_path: Path
) -> None:
    control = tmp_path / "control.json"
    control.write_bytes(encode_control(Request(1, stop=True, reason="test")))
    flags = ("--steps", "8", "--loss-log", str(tmp_path / "loss.jsonl"))
    r = gpt(read_only_store, *flags, env={"FTSUP_CONTROL_FILE": str(control)})
    assert "emergency_save_failed" in r.output, r.output[-3000:]
    # Read after step 3, agreed by the ranks during step 4 (Agreement), served after it.
    assert (r.returncode, logged_steps(tmp_path / "loss.jsonl")) == (1, [3, 4])
    info = layout.latest_consistent(read_only_store)
    assert info is not None and info.step == 2


@pytest.mark.multiprocess
def test_under_ftsup_run_an_eviction_on_a_full_disk_exits_8_naming_the_steps_lost(tmp_path: Path) -> None:
    import os
    import signal

    import yaml

    from ftsup.supervisor.policy.machine import EXIT_SAVE_LOST
    from ftsup.tools.faults.diskfull import Disk
    from tests.procs import REPO, kill_tree, wait_for

    if (why := Disk.unavailable()) is not None:
        pytest.skip(why)
    loss = tmp_path / "loss.jsonl"
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", *SMALL, "--steps", "200", "--min-step-s", "0.1"]
    with Disk(tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}", 64) as disk:
        cfg = {
            "job": {
                "command": [*command, "--loss-log", str(loss)],
                "workdir": str(REPO),
                "state_dir": str(tmp_path / "state"),
                "env": {"PYTHONPATH": PYTHONPATH},
            },
            "launch": {"nproc_per_node": 2},
            "checkpoint": {"dir": str(disk.store)},
            "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
            "eviction": {"signals": ["SIGUSR1"], "default_deadline_s": 30, "save_margin_s": 1},
        }
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
        argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(tmp_path / "job.yaml")]
        env = dict(os.environ, PYTHONPATH=PYTHONPATH)
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: max(logged_steps(loss), default=0) >= 5, 180, "the run never reached step 5")
            disk.fill()
            os.kill(proc.pid, signal.SIGUSR1)  # the notice comes while training goes on on a full disk
            rc = proc.wait(timeout=120)
            after = layout.latest_consistent(disk.store, deep=True)
        finally:
            kill_tree(proc.pid)
    events = [json.loads(x) for x in (tmp_path / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    assert rc == EXIT_SAVE_LOST and "save_requested" in names, names
    assert [e for e in events if e["event"] == "checkpoint_committed"] == []  # no emergency checkpoint claimed
    (failed,) = [e for e in events if e["event"] == "emergency_save_failed"]
    reached = logged_steps(loss)[-1]
    assert after is not None and (failed["step"], failed["checkpoint_step"]) == (reached, after.step)
    assert failed["lost_steps"] == [after.step + 1, reached] and failed["level"] == "error"
    assert "the ranks' emergency save failed" in failed["reason"]  # their word (save_failed_step), not the exit's
    (stopped,) = [e for e in events if e["event"] == "job_stopped"]
    assert (
        f"steps {after.step + 1}-{reached}, after the newest checkpoint, step {after.step}, are lost"
        in stopped["reason"]
    )
    log = (tmp_path / "state" / "logs" / "attempt-0001.log").read_text()
    assert "emergency_save_failed" in log
