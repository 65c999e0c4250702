"""The reference trainer under `ftsup run` while its checkpoint store fails: a store removed mid-run is made again
by the next save and the job finishes without a restart; an eviction's save that a read-only store refuses is
committed in the fallback directory, made durable, and resumed from by the next run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.store import layout
from ftsup.supervisor.policy.machine import EXIT_EVICTED
from tests.helpers import mounted_tmpfs
from tests.procs import PYTHONPATH, REPO, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

SMALL = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--corpus-bytes", "50000"]


def write_job(tmp: Path, store: Path, steps: int, **checkpoint: Any) -> Path:
    command = [sys.executable, "-m", "ftsup.trainer.examples.gpt", *SMALL, "--steps", str(steps), "--ckpt-every", "2"]
    cfg = {
        "job": {
            "command": [*command, "--min-step-s", "0.1", "--loss-log", str(tmp / "loss.jsonl")],
            "workdir": str(REPO),
            "state_dir": str(tmp / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 2},
        "checkpoint": {"dir": str(store), **checkpoint},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
        "eviction": {"signals": ["SIGUSR1"], "default_deadline_s": 30, "save_margin_s": 1},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(job: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def logged_steps(path: Path) -> list[int]:
    """Steps in the loss log (a line being written, not yet ended, is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["step"] for line in text.split("\n")[:-1]]


def events(tmp: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]


def removed(store: Path) -> bool:
    shutil.rmtree(store, ignore_errors=True)  # a save may write into it meanwhile: then again
    return not store.exists()


def test_a_store_removed_mid_run_is_made_again_and_the_job_finishes_without_a_restart(tmp_path: Path) -> None:
    store = tmp_path / "ckpt"
    proc = start(write_job(tmp_path, store, 24))
    try:
        wait_for(lambda: max(logged_steps(tmp_path / "loss.jsonl"), default=0) >= 8, 180, "step 8 never came")
        wait_for(lambda: removed(store), 10, "the store could not be removed")
        rc = proc.wait(timeout=180)
    finally:
        kill_tree(proc.pid)
    told = events(tmp_path)
    names = [e["event"] for e in told]
    assert (rc, names.count("workers_launched")) == (0, 1), names
    assert logged_steps(tmp_path / "loss.jsonl") == list(range(1, 25))  # never a step twice: no restart
    (made,) = [e for e in told if e["event"] == "checkpoint_dir_recreated"]
    assert made["step"] >= 8 and made["level"] == "warning"
    latest = layout.latest_consistent(store, deep=True)
    assert latest is not None and latest.step == 24
    assert "checkpoint_dir_recreated" in (tmp_path / "state" / "logs" / "attempt-0001.log").read_text()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    yield from mounted_tmpfs(tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}", "64m")


def test_an_emergency_save_a_read_only_store_refuses_goes_durable_from_the_fallback_and_is_resumed(
    tmpfs: Path, tmp_path: Path
) -> None:
    store, durable, fallback = tmpfs / "ckpt", tmp_path / "durable", tmp_path / "fallback"
    tier = {"url": str(durable), "fallback_dir": str(fallback), "periodic_every": 0}
    job = write_job(tmp_path, store, 200, durable=tier)
    proc = start(job)
    try:
        wait_for(lambda: max(logged_steps(tmp_path / "loss.jsonl"), default=0) >= 5, 180, "step 5 never came")
        assert subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)]).returncode == 0
        os.kill(proc.pid, signal.SIGUSR1)  # the notice comes while training goes on on a read-only store
        rc = proc.wait(timeout=120)
    finally:
        kill_tree(proc.pid)
    reached = logged_steps(tmp_path / "loss.jsonl")[-1]
    told = events(tmp_path)
    (committed,) = [e for e in told if e["event"] == "checkpoint_committed"]
    assert (rc, committed["step"], committed["fallback"]) == (EXIT_EVICTED, reached, True), [e["event"] for e in told]
    assert [e["step"] for e in told if e["event"] == "durable_committed"] == [reached]
    assert "emergency_save_failed" not in [e["event"] for e in told]
    assert subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)]).returncode == 0
    again = start(job)  # the same job, with its store writable again
    try:
        wait_for(lambda: len(logged_steps(tmp_path / "loss.jsonl")) > reached, 180, "the rerun logged no step")
        os.kill(again.pid, signal.SIGUSR1)
        assert again.wait(timeout=120) == EXIT_EVICTED
    finally:
        kill_tree(again.pid)
    chosen = [e for e in events(tmp_path) if e["event"] == "checkpoint_chosen"]
    assert (chosen[-1]["step"], chosen[-1]["tier"]) == (reached, "durable")
    assert logged_steps(tmp_path / "loss.jsonl")[reached] == reached + 1  # not one step lost
