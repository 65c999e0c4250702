"""The durable tier under `ftsup run`: the reference trainer with `checkpoint.durable: s3://...` on the tests' real
S3 store (SeaweedFS). What the config picks reaches the store, committed and verified, and retention keeps what it
must; the store down meanwhile never stalls training and nothing partial is ever listed; an eviction exits 5 only
once its emergency checkpoint is durable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.store import durable, layout
from ftsup.supervisor.policy.machine import EXIT_EVICTED
from tests.procs import PYTHONPATH, REPO, kill_tree, wait_for
from tests.s3fixtures import client, start_server, use_server

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

TRAINER = ["-m", "ftsup.trainer.examples.gpt", "--ckpt-every", "5"]
TRAINER += ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "50000"]


def write_job(tmp: Path, durable_tier: object, *, steps: int, min_step_s: float, **sections: Any) -> Path:
    command = [sys.executable, *TRAINER, "--steps", str(steps), "--min-step-s", str(min_step_s)]
    command += ["--loss-log", str(tmp / "loss.jsonl")]
    cfg = {
        "job": {
            "command": command,
            "workdir": str(REPO),
            "state_dir": str(tmp / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 1, "warm_agent": False},
        "checkpoint": {"dir": str(tmp / "ckpt"), "durable": durable_tier},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
        "eviction": {"default_deadline_s": 30, "save_margin_s": 2},
        **sections,
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(job: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    return subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def events(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "state" / "logs" / "supervisor.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def named(tmp: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in events(tmp) if e["event"] == name]


def last_step(tmp: Path) -> int:
    log = tmp / "loss.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return json.loads(lines[-1])["step"] if lines else -1


def listed(url: str) -> tuple[list[tuple[int, str | None, bool]], list[str]]:
    """The tier's checkpoints, each deep-checked, and the names under it that are not one."""
    with durable.open_tier(url) as tier:
        got = tier.list_checkpoints(deep=True)
    return [(c.step, c.kind, c.consistent) for c in got.checkpoints], got.others


def test_the_picked_checkpoints_reach_the_store_and_durable_retention_keeps_the_newest_and_a_rollbacks_history(
    bucket: str, tmp_path: Path
) -> None:
    # Periodic checkpoints at 5, 10, ..., 25 and the final one at 30: every 2nd periodic goes (10, 20) and the
    # final. Retention keeps the newest (keep_last 1) and the newest at least 10 steps older (a rollback's).
    url = f"s3://{bucket}/job"
    tier = {"url": url, "periodic_every": 2, "keep_last": 1}
    job = write_job(tmp_path, tier, steps=30, min_step_s=0.2, anomaly={"detection_window_steps": 10})
    proc = start(job)
    try:
        assert proc.wait(timeout=120) == 0
    finally:
        kill_tree(proc.pid)
    committed = sorted(e["step"] for e in named(tmp_path, "durable_committed"))
    deleted = [e["step"] for e in named(tmp_path, "durable_deleted")]
    # (SeaweedFS keeps a deleted checkpoint's folder, empty, which a listing shows beside the checkpoints.)
    assert (committed, deleted, listed(url)[0]) == ([10, 20, 30], [10], [(20, "periodic", True), (30, "final", True)])


def test_training_goes_on_while_the_store_is_down_and_the_upload_completes_once_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = start_server(tmp_path / "seaweedfs")
    proc = None
    try:
        use_server(monkeypatch, server, tmp_path)
        client(server).create_bucket(Bucket="down")
        url = "s3://down/job"
        job = write_job(tmp_path, url, steps=60, min_step_s=0.1)
        server.stop()
        proc = start(job)
        failed = wait_for(lambda: named(tmp_path, "durable_upload_failed"), 90, "no upload ever failed")
        at = last_step(tmp_path)
        wait_for(lambda: last_step(tmp_path) >= at + 10 or proc.poll() is not None, 60, "training stalled")
        assert proc.poll() is None and last_step(tmp_path) >= at + 10  # ten steps more while the store is down
        server.start()
        seen: set[tuple[int, bool]] = set()  # every checkpoint the tier listed while the uploads went on

        def finished() -> bool:
            with durable.open_tier(url) as tier:
                seen.update((c.step, c.consistent) for c in tier.list_checkpoints().checkpoints)
            return proc is not None and proc.poll() is not None

        wait_for(finished, 120, "the job never finished")
        code = proc.wait(timeout=10)
        got = listed(url)
    finally:
        if proc is not None:
            kill_tree(proc.pid)
        server.stop()
    newest = layout.latest_consistent(tmp_path / "ckpt")
    checkpoints, others = got
    assert (code, newest is not None, failed[0]["step"] > 0, others) == (0, True, True, [])
    assert newest is not None and checkpoints[-1] == (newest.step, "final", True)
    assert all(ok for _, ok in seen) and all(ok for _, _, ok in checkpoints)


def test_an_eviction_exits_5_only_once_its_emergency_checkpoint_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store is down when the notice comes: the supervisor waits (within the notice's 30 s) for the emergency
    # checkpoint's upload, which goes through once the store is back.
    server = start_server(tmp_path / "seaweedfs")
    proc = None
    try:
        use_server(monkeypatch, server, tmp_path)
        client(server).create_bucket(Bucket="evicted")
        job = write_job(tmp_path, {"url": "s3://evicted/job", "periodic_every": 0}, steps=200, min_step_s=0.1)
        proc = start(job)
        wait_for(lambda: last_step(tmp_path) >= 7 or proc.poll() is not None, 90, "step 7 never logged")
        server.stop()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: named(tmp_path, "checkpoint_committed") or proc.poll() is not None, 30, "no save")
        wait_for(lambda: named(tmp_path, "durable_upload_failed") or proc.poll() is not None, 30, "no failed upload")
        waiting = proc.poll() is None and not named(tmp_path, "supervisor_exited")  # the store is still down
        server.start()
        code = proc.wait(timeout=60)
        got = listed("s3://evicted/job")
    finally:
        if proc is not None:
            kill_tree(proc.pid)
        server.stop()
    step = named(tmp_path, "checkpoint_committed")[-1]["step"]
    kind = layout.inspect_checkpoint(tmp_path / "ckpt" / layout.step_dirname(step)).kind
    order = [e["event"] for e in events(tmp_path) if e["event"] in ("durable_committed", "supervisor_exited")]
    assert (waiting, code, got, order) == (
        True,
        EXIT_EVICTED,
        ([(step, kind, True)], []),
        ["durable_committed", "supervisor_exited"],
    )
