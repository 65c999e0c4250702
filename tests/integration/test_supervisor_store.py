"""`ftsup run` over a hostile checkpoint store: the daemon reads the store on a thread of its own,
so files planted in it mid-run (a FIFO manifest, one nested 5000 deep, one of 150,000 entries)
neither kill nor freeze it, and a hang is still detected within its timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from ftsup.store import checksums, layout
from tests.helpers import default_files, make_fake_checkpoint
from tests.procs import PYTHONPATH, REPO, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

SMALL_MODEL = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--corpus-bytes", "200000"]
TRAINER = ["-m", "ftsup.trainer.examples.gpt", "--steps", "16", "--ckpt-every", "4", *SMALL_MODEL]


def write_job(tmp: Path, *trainer_args: str) -> Path:
    cfg = {
        "job": {
            "command": [sys.executable, *TRAINER, "--loss-log", str(tmp / "loss.jsonl"), *trainer_args],
            "workdir": str(REPO),
            "state_dir": str(tmp / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 2},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def hostile(root: Path) -> list[Path]:
    """Newer than anything the run writes: a FIFO manifest, one nested 5000 deep, one of 150,000 entries, made in
    `root` ahead of time, so that moving them into the store takes a rename each."""
    fifo = make_fake_checkpoint(root, 97, default_files(3))
    (fifo / layout.MANIFEST_NAME).unlink()
    os.mkfifo(fifo / layout.MANIFEST_NAME)
    nested = make_fake_checkpoint(root, 98, default_files(4))
    (nested / layout.MANIFEST_NAME).write_bytes(b'{"files": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    huge = make_fake_checkpoint(root, 99, default_files(5))
    obj = json.loads((huge / layout.MANIFEST_NAME).read_text())
    entry = {"size": 1, "checksum": checksums.checksum_bytes(b"x")}
    obj["files"].update({f"shard-{i:06d}.safetensors": entry for i in range(150_000)})
    (huge / layout.MANIFEST_NAME).write_text(json.dumps(obj))
    return [fifo, nested, huge]


def test_a_hang_is_detected_in_time_while_the_store_is_hostile(tmp_path: Path) -> None:
    job = write_job(tmp_path, "--fault", "stop@10", "--fault-rank", "1", "--min-step-s", "0.3")
    planted = hostile(tmp_path / "hostile")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=PYTHONPATH),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (tmp_path / "ckpt" / layout.step_dirname(4)).is_dir(), 180, "no first checkpoint")
        for ckpt in planted:  # before the hang at step 10, while the daemon scans
            ckpt.rename(tmp_path / "ckpt" / ckpt.name)
        planted_at = datetime.now(UTC).isoformat()
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, out[-4000:]
    events = [json.loads(x) for x in (tmp_path / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]
    hangs = [e for e in events if e["event"] == "heartbeat_timed_out"]
    assert len(hangs) == 1, [e["event"] for e in events]
    silent, timeout = map(float, re.search(r"silent for ([\d.]+)s \(timeout ([\d.]+)s\)", hangs[0]["reason"]).groups())  # type: ignore[union-attr]
    assert silent <= timeout + 1.0
    timeline = [(e["timestamp"], e["event"], e.get("step"), e.get("reason")) for e in events]
    quarantined = sorted(e["step"] for e in events if e["event"] == "checkpoint_quarantined")
    assert quarantined == [97, 98, 99], (f"planted at {planted_at}", timeline)
