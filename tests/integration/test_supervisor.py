"""`ftsup run` keeping the reference trainer alive: real torchrun, gloo, CPU.

Each test writes a job config, runs the supervisor as a real process, and checks the loss log
(each step's line from the last attempt that logged it) against an uninterrupted run. A SIGSTOPped rank and a
SIGKILLed supervisor, each followed by a run bitwise the uninterrupted one, are `ftsup demo`'s faults (test_demo.py)
and the reduced chaos run's (test_chaos.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from ftsup.store import layout
from tests.procs import PYTHONPATH, REPO, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

STEPS = 16
SMALL_MODEL = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "32", "--corpus-bytes", "200000"]
TRAINER = ["-m", "ftsup.trainer.examples.gpt", "--steps", str(STEPS), "--ckpt-every", "4", *SMALL_MODEL]


def write_job(tmp: Path, *trainer_args: str, nproc: int = 2, **sections: dict) -> Path:
    cfg: dict = {
        "job": {
            "command": [sys.executable, *TRAINER, "--loss-log", str(tmp / "loss.jsonl"), *trainer_args],
            "workdir": str(REPO),
            "state_dir": str(tmp / "state"),
            "env": {"PYTHONPATH": PYTHONPATH},
        },
        "launch": {"nproc_per_node": nproc},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ftsup(*args: str, timeout: float = 240):
    return run([sys.executable, "-m", "ftsup.supervisor.cli", *args], timeout=timeout)


def last_lines(log: Path) -> dict[int, dict]:
    out = {}
    for line in log.read_text().splitlines():
        j = json.loads(line)
        out[j["step"]] = j
    return out


def events(tmp: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("ref")
    r = ftsup("run", "--config", str(write_job(tmp)))
    assert r.returncode == 0, r.output[-4000:]
    return last_lines(tmp / "loss.jsonl")


def hexes(lines: dict[int, dict]) -> dict[int, str]:
    return {s: j["loss_hex"] for s, j in lines.items()}


@pytest.mark.parametrize("warm", [True, False], ids=["warm-agent", "cold-agent"])
def test_sigkilled_rank_is_restarted_and_the_run_is_bitwise_uninterrupted(reference, tmp_path, warm):
    # The cold agent's run keeps a memory tier too: the relaunch reads the checkpoint from it, bitwise the same.
    memory = {} if warm else {"memory": {"dir": str(tmp_path / "shm"), "keep_last": 1}}
    job = write_job(tmp_path, "--fault", "kill@7", "--fault-rank", "1", launch={"warm_agent": warm}, checkpoint=memory)
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 0, r.output[-4000:]
    assert hexes(last_lines(tmp_path / "loss.jsonl")) == hexes(reference)
    if not warm:
        assert [s for s, _ in layout.committed_dirs(tmp_path / "shm")] == [STEPS]
        first, relaunch = ((tmp_path / "state" / "logs" / f"attempt-000{n}.log").read_text() for n in (1, 2))
        # The memory copy follows the disk commit in the writer thread: on a loaded host the kill at step 7 can come
        # before step 4 reached memory, and then the relaunch reads the disk's. The kill can also come between that
        # commit and its log line, so a commit the first attempt logged means memory, and no log line means either.
        in_memory = f"path={tmp_path / 'shm' / layout.step_dirname(4)} " in first
        tiers = relaunch.count("tier=memory")
        assert "step=4 " in relaunch and tiers in ((2,) if in_memory else (0, 2)), relaunch[-3000:]
    evs = events(tmp_path)
    names = [e["event"] for e in evs]
    assert names.count("workers_launched") == 2 and "job_succeeded" in names
    parked = {e["attempt"]: e["pid"] for e in evs if e["event"] == "spare_agent_parked"}
    used = {e["attempt"]: e["pid"] for e in evs if e["event"] == "spare_agent_used"}
    if warm:  # the relaunch ran in the spare parked while attempt 1 trained; attempt 2's own spare went unused
        assert 2 in parked and used == {2: parked[2]}, (parked, used)
        started = [e for e in evs if e["event"] == "workers_launched"]
        assert started[1]["attempt"] == 2
    else:
        assert parked == used == {}
    # Nothing left: no rank, agent or spare (a spare's command line names no path of the job; its environment does).
    assert not [
        p
        for p in psutil.process_iter(["environ"], ad_value=None)
        if any(str(tmp_path) in v for v in (p.info["environ"] or {}).values())
    ]


def test_unhealthy_slot_shrinks_the_world_size_and_keeps_the_global_batch(reference, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(  # healthy: both slots on the first probe, slot 1 gone afterwards
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(tmp_path / 'probes')!r})\n"
        "n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        "print('0 1' if n == 0 else '0')\n"
    )
    # Steps of at least 0.5 s: step 4's asynchronous save is committed before the kill at step 6 (at full speed the
    # kill came first once, and the relaunch rightly started from scratch).
    job = write_job(
        tmp_path,
        *("--fault", "kill@6", "--fault-rank", "1", "--min-step-s", "0.5"),
        launch={"health_command": [sys.executable, str(probe)]},
    )
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 0, r.output[-4000:]
    got = last_lines(tmp_path / "loss.jsonl")
    resumed = [e for e in events(tmp_path) if e["event"] == "workers_launched"][-1]
    assert (resumed["world_size"], resumed["resume_step"]) == (1, 4)
    assert [got[s]["world_size"] for s in range(5, STEPS + 1)] == [1] * (STEPS - 4)
    assert [got[s]["samples"] for s in sorted(got)] == [12 * s for s in range(1, STEPS + 1)]
    for s in range(5, STEPS + 1):
        assert got[s]["loss"] == pytest.approx(reference[s]["loss"], rel=1e-4)


def test_crash_loop_stops_with_its_exit_code_and_says_why(tmp_path):
    fault = ("--fault", "exit@3", "--fault-attempt", "-1", "--ckpt-every", "100")
    job = write_job(tmp_path, *fault, restart={"max_attempts_without_progress": 2, "backoff_initial_s": 0.1})
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 3, r.output[-4000:]
    crash = [e for e in events(tmp_path) if e["event"] == "crash_loop_detected"]
    assert len(crash) == 1 and "2 attempts in a row made no step progress" in crash[0]["reason"]
    assert [e["event"] for e in events(tmp_path)].count("workers_launched") == 3


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("restart", "backof_initial_s", 1, "restart.backof_initial_s"),
        ("launch", "min_world_size", 9, "launch.min_world_size"),
        ("heartbeat", "timeout_s", -1, "heartbeat.timeout_s"),
    ],
)
def test_a_bad_config_exits_2_with_one_line_naming_the_key_and_launches_nothing(
    tmp_path, section, key, value, expected
):
    job = write_job(tmp_path, **{section: {key: value}})
    r = ftsup("run", "--config", str(job), timeout=60)
    assert r.returncode == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("ftsup: error:")
    assert not (tmp_path / "state").exists() and not (tmp_path / "loss.jsonl").exists()


def test_a_save_twenty_times_longer_than_a_step_raises_no_false_alarm(tmp_path):
    # Steps of ~0.1 s give a learned hang timeout of max(3 x p99, 2 s) = 2 s; each periodic save
    # blocks for 2.5 s (25 steps' worth) inside the "save" phase.
    job = write_job(tmp_path, "--min-step-s", "0.1", "--save-delay-s", "2.5", "--steps", "12")
    r = ftsup("run", "--config", str(job))
    assert r.returncode == 0, r.output[-4000:]
    evs = [e["event"] for e in events(tmp_path)]
    assert evs.count("workers_launched") == 1
    assert [e for e in evs if e.endswith("timed_out")] == []


def test_rank_0_evaluating_alone_longer_than_the_hang_timeout_is_no_hang_and_changes_no_step(reference, tmp_path):
    # Steps of ~0.1 s give a learned hang timeout of 2 s; rank 0 alone evaluates for over 3 s after steps 5, 10 and
    # 15 inside session.phase("eval"), while rank 1 goes on into the next step and waits for it in its all-reduce.
    r = ftsup(
        "run", "--config", str(write_job(tmp_path, "--min-step-s", "0.1", "--eval-every", "5", "--eval-pad-s", "3"))
    )
    assert r.returncode == 0, r.output[-4000:]
    evs = [e["event"] for e in events(tmp_path)]
    evaluated = [
        json.loads(line.split(": ", 1)[1])["eval_step"] for line in r.output.splitlines() if "eval_step" in line
    ]
    told = (evs.count("workers_launched"), [e for e in evs if e.endswith("timed_out")], evaluated)
    assert (told, hexes(last_lines(tmp_path / "loss.jsonl"))) == ((1, [], [5, 10, 15]), hexes(reference))
