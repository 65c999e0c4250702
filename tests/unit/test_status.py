"""`ftsup status`: whether a supervisor runs at all, the ranks as last heard and the latest checkpoint, from the
files of a state directory (written by the real writers, or planted, as hostile input)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftsup.protocol import Beat, Phase
from ftsup.supervisor.cli.commands import main
from ftsup.supervisor.state import ranks as rankstatus
from ftsup.supervisor.state.journal import Journal, JournalRecord
from tests.helpers import default_files, make_fake_checkpoint


def job(tmp: Path) -> Path:
    (tmp / "state").mkdir(mode=0o700)
    config = tmp / "job.yaml"
    raw = {
        "job": {"command": ["true"], "state_dir": str(tmp / "state"), "run_id": "r"},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    config.write_text(yaml.safe_dump(raw))
    return config


def journal(tmp: Path, **fields: Any) -> None:
    record: dict[str, Any] = {
        "run_id": "r",
        "node_id": "n",
        "supervisor_pid": os.getpid(),
        "status": "running",
        "updated_unix": time.time(),
        "extra": {"metrics": "127.0.0.1:9400"},
    } | fields
    Journal(tmp / "state" / "journal.json").write(JournalRecord(**record))


def status(config: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    code = main(["status", "--config", str(config), *flags])
    out, err = capsys.readouterr()
    assert err == ""
    return code, out


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_journal_whose_supervisor_is_gone_says_not_running_and_shows_no_metrics_url(tmp_path, capsys) -> None:
    config = job(tmp_path)
    journal(tmp_path, supervisor_pid=a_dead_pid(), resume_step=None)
    code, out = status(config, capsys)
    assert code == 0 and "supervisor not running" in out and "is gone" in out
    assert "metrics" not in out and "None" not in out and "from scratch" in out


def test_a_pid_that_was_reused_after_the_journal_was_written_is_not_its_supervisor(tmp_path, capsys) -> None:
    config = job(tmp_path)
    journal(tmp_path, updated_unix=1000.0)  # this process was created long after that
    _, out = status(config, capsys, "--json")
    assert json.loads(out)["supervisor_running"] is False


def test_a_live_supervisor_shows_its_ranks_step_phase_loss_and_heartbeat_age(tmp_path, capsys) -> None:
    config = job(tmp_path)
    journal(tmp_path, attempt=2, world_size=2, resume_step=8)
    table = rankstatus.RankTable(
        tmp_path / "state" / rankstatus.FILE_NAME, write=lambda path, op: op(), wall=lambda: time.time() - 3
    )
    table.started(2)
    for rank in range(2):
        table.heard(Beat(2, rank, rank, 4000 + rank, 17, Phase.TRAIN, 0.0, 0.0, (("loss", 3.25),)))
    table.flush(0.0)
    make_fake_checkpoint(tmp_path / "ckpt", 16, default_files())
    _, out = status(config, capsys, "--json")
    got = json.loads(out)
    assert (got["supervisor_running"], got["metrics_url"], got["latest_checkpoint"]["step"]) == (
        True,
        "http://127.0.0.1:9400/metrics",
        16,
    )
    heard = [(r["rank"], r["step"], r["phase"], r["loss"]) for r in got["ranks"]]
    assert heard == [(0, 17, "train", 3.25), (1, 17, "train", 3.25)]
    assert all(2.5 < r["heartbeat_age_s"] < 60 for r in got["ranks"])
    _, text = status(config, capsys)
    assert "rank 1 (local 1, pid 4001): step 17, train, loss 3.25, last heartbeat" in text
    assert "resumed from step 8" in text and "latest consistent checkpoint: step 16" in text


def test_the_ranks_table_is_written_at_most_once_a_second() -> None:
    writes: list[Path] = []
    table = rankstatus.RankTable(Path("/nowhere/ranks.json"), write=lambda path, op: writes.append(path))
    table.started(1)
    for t in (0.0, 0.3, 0.6, 0.9, 1.2):
        table.heard(Beat(1, 0, 0, 10, int(t * 10), Phase.TRAIN, 0.0, 0.0))
        table.flush(t)
    assert len(writes) == 2  # at 0.0 and 1.2


RANK = {"rank": 0, "local_rank": 0, "pid": 1, "step": 1, "phase": "train", "loss": 1.0, "beat_unix": 1.0}


@pytest.mark.parametrize(
    "planted",
    [
        {"format": 1, "attempt": 1, "written_unix": 1.0, "ranks": [RANK | {"step": -1}]},
        {"format": 1, "attempt": 1, "written_unix": 1.0, "ranks": [RANK | {"phase": "\x1b[2J"}]},
        {"format": 1, "attempt": 1, "written_unix": 1.0, "ranks": [RANK] * 5000},
        {"format": 2},
        "[" * 100_000,
    ],
    ids=["negative step", "not a phase", "too many ranks", "another format", "deep nesting"],
)
def test_a_planted_ranks_file_is_ignored_saying_why(tmp_path, capsys, planted: object) -> None:
    config = job(tmp_path)
    journal(tmp_path)
    body = planted if isinstance(planted, str) else json.dumps(planted)
    (tmp_path / "state" / rankstatus.FILE_NAME).write_text(body)
    code, out = status(config, capsys, "--json")
    got = json.loads(out)
    assert (code, got["ranks"], got["ranks_problem"].startswith("ignored: ")) == (0, [], True)


def test_a_ranks_file_planted_as_a_link_is_not_read(tmp_path, capsys) -> None:
    config = job(tmp_path)
    journal(tmp_path)
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"format": 1, "attempt": 1, "written_unix": 1.0, "ranks": []}))
    (tmp_path / "state" / rankstatus.FILE_NAME).symlink_to(real)
    _, out = status(config, capsys, "--json")
    assert "ignored" in json.loads(out)["ranks_problem"]
