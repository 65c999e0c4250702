"""`ftsup status` shows the memory tier: its use, its own checkpoints and the replicas of its peers' parts it holds,
never following a link planted among them."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import yaml

from ftsup.store import layout
from ftsup.supervisor.cli.commands import main


def test_status_shows_the_memory_tiers_use_own_steps_and_replicas(tmp_path: Path) -> None:
    mem = tmp_path / "mem"
    (mem / layout.step_dirname(8)).mkdir(parents=True)
    (mem / layout.step_dirname(8) / "shard-00000.safetensors").write_bytes(b"x" * 1000)
    for step in (4, 8):
        (mem / "peers" / "node-b" / layout.step_dirname(step)).mkdir(parents=True)
    (mem / "peers" / "node-c").symlink_to(mem / "peers" / "node-b")  # planted: never listed
    cfg = {
        "job": {"command": ["true"], "run_id": "gpt-7", "state_dir": str(tmp_path / "state")},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "memory": {"dir": str(mem), "replicas": 1}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["status", "--config", str(path), "--json"]) == 0
    memory = json.loads(out.getvalue())["memory"]
    got = {k: memory[k] for k in ("dir", "bytes_used", "steps", "replicas", "replicas_configured")}
    assert got == {
        "dir": str(mem),
        "bytes_used": 1000,
        "steps": [8],
        "replicas": {"node-b": [4, 8]},
        "replicas_configured": 1,
    }
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["status", "--config", str(path)]) == 0
    assert "replicas of peers (1 configured per node): node-b steps [4, 8]" in out.getvalue()


def test_the_metrics_show_the_tiers_use_and_the_replicas_held(tmp_path: Path) -> None:
    from ftsup.supervisor.state import memview
    from ftsup.supervisor.telemetry.metrics import Metrics

    for node, steps in (("node-b", (4, 8)), ("node-c", (8, 12))):
        for step in steps:
            (tmp_path / "peers" / node / layout.step_dirname(step)).mkdir(parents=True)
    (tmp_path / "peers" / "node-b" / layout.step_dirname(8) / "shard-00001.safetensors").write_bytes(b"x" * 10)
    metrics = Metrics("r", "node-a", started_unix=0.0)
    metrics.memory_tier(memview.read(tmp_path, 1, 2))
    text = metrics.render().decode()
    got = [line for line in text.splitlines() if line.startswith("ftsup_memory_tier")]
    assert got == [
        "ftsup_memory_tier_bytes 10.0",
        "ftsup_memory_tier_replicas 2.0",
        "ftsup_memory_tier_replica_step 8.0",
    ]
    metrics.memory_tier(None)
    assert "ftsup_memory_tier_bytes -1.0" in metrics.render().decode()
