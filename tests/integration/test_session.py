"""`ftsup.Session` with real processes: the supervisor's requests agreed across ranks one step after
they were read, an evaluation that hangs caught by its phase's own timeout under `ftsup run`, and
every save's duration reported by the engine itself. The job is `tests/bin/session_job.py` (a
linear model with dropout); the plain PyTorch example is `test_plain_example.py`'s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from ftsup.protocol import CHECKPOINT_DIR_ENV, CONTROL_FILE_ENV, HEARTBEAT_SOCKET_ENV, Request, encode_control
from ftsup.store import layout
from ftsup.supervisor.run.heartbeat import HeartbeatReceiver
from tests.procs import BIN, PYTHONPATH, REPO, run

pytestmark = pytest.mark.multiprocess


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_every_committed_save_is_reported_to_the_supervisor_with_its_duration_whoever_called_it(tmp_path):
    with HeartbeatReceiver(tmp_path / "run") as receiver:
        # Three background saves of a script that reports nothing itself.
        argv = ["save", "--dir", str(tmp_path / "ckpt"), "--parallel", "none", "--steps", "1,2,3", "--async"]
        argv += ["--out", str(tmp_path / "out.json")]
        r = run([sys.executable, str(BIN / "ckpt_worker.py"), *argv], env={HEARTBEAT_SOCKET_ENV: str(receiver.path)})
        assert r.returncode == 0, r.output[-3000:]
        durations = [value for beat in receiver.drain() for name, value in beat.figures if name == "save_s"]
    assert (len(durations), all(d > 0 for d in durations)) == (3, True)


def test_a_request_read_by_one_rank_is_served_by_every_rank_at_the_next_step(tmp_path):
    control = tmp_path / "control.json"
    control.write_bytes(encode_control(Request(1, stop=True, reason="eviction")))
    log = tmp_path / "log.rank{rank}.jsonl"
    env = {CONTROL_FILE_ENV: str(control), CHECKPOINT_DIR_ENV: str(tmp_path / "ckpt")}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    argv += [str(BIN / "session_job.py"), "--steps", "6", "--record", str(log), "--control-rank", "1"]
    r = run(argv, env=env)
    assert r.returncode == 0, r.output[-3000:]
    # Read at step 1 (by rank 1 only), agreed during step 2, served after it on both ranks.
    ends = [lines(Path(str(log).replace("{rank}", str(rank))))[-1] for rank in (0, 1)]
    assert ends == [{"end": 2, "stopped": True, "finished": False}] * 2
    latest = layout.latest_consistent(tmp_path / "ckpt")
    assert (latest.step, latest.kind) == (2, "emergency")


def test_a_hang_inside_an_eval_is_caught_by_the_phases_own_timeout_and_the_job_finishes(tmp_path):
    command = [sys.executable, str(BIN / "session_job.py"), "--steps", "8", "--eval-every", "4", "--eval-s", "0.1"]
    command += ["--eval-timeout-s", "1", "--hang-in-eval", "--record", str(tmp_path / "log.jsonl")]
    job = {
        "job": {
            "command": command,
            "workdir": str(REPO),
            "state_dir": str(tmp_path / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    r = run([sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(tmp_path / "job.yaml")], timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    events = lines(tmp_path / "state" / "logs" / "supervisor.jsonl")
    failures = [e for e in events if e["event"].endswith("timed_out") or e["event"] == "worker_exited"]
    assert [(e["event"], "in phase eval" in e["reason"]) for e in failures] == [("heartbeat_timed_out", True)]
    assert lines(tmp_path / "log.jsonl")[-1] == {"end": 8, "stopped": False, "finished": True}
