"""Auto-instrumentation under `ftsup run -- CMD`, no YAML file: scripts without a line of ftsup get hang detection from
their optimizer steps; `--no-instrument` leaves a script as it was; a script that uses ftsup itself is left alone.

`tests/bin/elastic_ddp.py` is written after PyTorch's torchrun tutorial (DDP, its own snapshot every epoch): its
rank 1 SIGSTOPped mid-run is caught as a hang within the timeout rule and named, and the job goes on from the
script's snapshot. The nanoGPT-style baseline (`trainer/examples/nanogpt_baseline.py`), whose rank 0 alone evaluates,
is not taken for a hang while it does, and a collective given no timeout gets the configured one. Each run starts in
a directory of its own, where the state directory (`.ftsup/<node>`) lands.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ftsup.supervisor.run.instrument import hook_dir
from ftsup.supervisor.state import ranks
from ftsup.tools.faults import chaos
from ftsup.trainer.examples import corpus
from tests.procs import BIN, PYTHONPATH, REPO, kill_tree, run, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}
FAST = ["--restart-backoff-initial-s", "0.2", "--restart-stop-grace-s", "3"]
TICK_SLACK_S = 1.5  # the loop's tick and the kernel's scheduling of a loaded host, past the timeout itself


def ftsup(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftsup.supervisor.cli", *args]


def events(workdir: Path) -> list[dict[str, Any]]:
    [log] = (workdir / ".ftsup").glob("*/logs/supervisor.jsonl")
    return [json.loads(line) for line in log.read_text().splitlines()]


def state_dir(workdir: Path) -> Path | None:
    found = [p for p in (workdir / ".ftsup").glob("*") if (p / "journal.json").exists()]
    return found[0] if found else None


def rank_step(workdir: Path, rank: int) -> int:
    """The step the supervisor last heard from `rank` (its `ranks.json`), 0 before it heard one."""
    where = state_dir(workdir)
    heard = ranks.read(where / "ranks.json") if where is not None else None
    return next((r.step for r in (heard[2] if heard else []) if r.rank == rank), 0)


def unix(event: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def test_a_sigstopped_rank_of_a_script_without_ftsup_is_caught_as_a_hang_named_and_the_job_goes_on(tmp_path):
    script = [str(BIN / "elastic_ddp.py"), "4", "1", "--batch_size", "64", "--pause_s", "0.05"]
    argv = ftsup("run", "--nproc-per-node", "2", "--heartbeat-min-timeout-s", "2", *FAST, "--", *script)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **ENV)
    with (tmp_path / "ftsup.out").open("w") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # Past the first epoch (16 steps), whose snapshot rank 0 has saved.
        wait_for(lambda: rank_step(tmp_path, 1) > 20, 120, lambda: (tmp_path / "ftsup.out").read_text()[-3000:])
        where = state_dir(tmp_path)
        assert where is not None
        stopped_at = chaos.send(chaos.supervised_ranks(where)[1], signal.SIGSTOP)
        code = proc.wait(timeout=180)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    seen = events(tmp_path)
    [hang] = [e for e in seen if e["event"] == "heartbeat_timed_out"]
    launched = [e["attempt"] for e in seen if e["event"] == "workers_launched"]
    assert (code, launched, hang["attempt"], hang["rank"]) == (0, [1, 2], 1, 1), (tmp_path / "ftsup.out").read_text()
    assert hang["timeout_s"] >= 2.0 and unix(hang) - stopped_at <= hang["timeout_s"] + TICK_SLACK_S, hang
    second = next(where.glob("logs/attempt-0002.log")).read_text()
    assert "Resuming training from snapshot at Epoch" in second  # the script's own resume, as without ftsup
    # The relaunch ran in the spare agent parked meanwhile, and its ranks were instrumented all the same.
    reached = [e["attempt"] for e in seen if e["event"] == "first_step_reached"]
    assert (reached, "spare_agent_used" in [e["event"] for e in seen]) == ([1, 2], True)


def test_rank_zero_evaluating_alone_longer_than_the_timeout_is_no_hang_of_a_script_without_ftsup(tmp_path):
    """nanoGPT's way: rank 0 alone evaluates (`model.eval()` ... `model.train()`) at the top of an iteration while the
    other rank goes on and waits for it in its gradients' all-reduce; each evaluation outlasts the heartbeat timeout."""
    tokens = corpus.generate(1 << 16).numpy().astype(np.uint16)
    tokens[:60_000].tofile(tmp_path / "train.bin")
    tokens[60_000:].tofile(tmp_path / "val.bin")
    script = [str(REPO / "trainer/examples/nanogpt_baseline.py"), "--max_iters=10", "--eval_interval=5"]
    script += ["--eval_iters=2", "--min_eval_s=3.0", "--min_iter_s=0.05", f"--data_dir={tmp_path}"]
    script += [f"--out_dir={tmp_path / 'out'}"]
    argv = ftsup("run", "--nproc-per-node", "2", "--heartbeat-min-timeout-s", "2", *FAST, "--", *script)
    r = run(argv, cwd=tmp_path, env=ENV, timeout=180)
    seen = [e["event"] for e in events(tmp_path)]
    failures = [e for e in seen if e.endswith("_timed_out") or e == "worker_exited"]
    assert (r.returncode, seen.count("workers_launched"), failures) == (0, 1, []), r.output[-3000:]
    assert "first_step_reached" in seen  # its steps were reported: detection was on during the evaluations


def test_a_collective_the_script_gave_no_timeout_fails_after_the_configured_one(tmp_path):
    """Rank 1 never joins rank 0's all-reduce; torch's default would keep rank 0 waiting for half an hour."""
    argv = ftsup("run", "--nproc-per-node", "2", "--heartbeat-mode", "off", "--heartbeat-save-timeout-s", "2")
    argv += ["--heartbeat-collective-timeout-s", "4", "--max-restarts", "0", "--"]
    r = run([*argv, str(BIN / "collective_wait.py"), "30"], cwd=tmp_path, env=ENV, timeout=120)
    waited = re.search(r"all_reduce failed after ([0-9.]+) s: .*Timed out", r.output)
    assert waited is not None and 4.0 <= float(waited[1]) < 10.0, r.output[-3000:]


def test_no_instrument_leaves_a_script_as_it_was(tmp_path):
    found = {}
    for flags in ([], ["--no-instrument"]):
        workdir = tmp_path / ("plain" if flags else "instrumented")
        workdir.mkdir()
        probe = [str(BIN / "instrument_probe.py"), str(workdir / "probe.json")]
        # The suite's own start-up hook (tests/site) left out: the probe names the `sitecustomize` it runs under.
        r = run(ftsup("run", *flags, "--", *probe), cwd=workdir, env={**ENV, "PYTHONPATH": str(REPO)}, timeout=120)
        assert r.returncode == 0, r.output[-3000:]
        started = [e for e in events(workdir) if e["event"] in ("supervisor_started", "first_step_reached")]
        found[bool(flags)] = (json.loads((workdir / "probe.json").read_text()), [e["event"] for e in started])
    ours = str(hook_dir() / "sitecustomize.py")
    instrumented, plain = found[False], found[True]
    assert (instrumented[0]["sitecustomize"], instrumented[0]["wrapped"]) == (ours, True)
    assert instrumented[1] == ["supervisor_started", "first_step_reached"]
    assert (plain[0]["sitecustomize"] != ours, plain[0]["wrapped"], plain[1]) == (True, False, ["supervisor_started"])
    assert str(hook_dir()) not in plain[0]["pythonpath"] + instrumented[0]["pythonpath"]


def test_a_script_that_beats_itself_is_left_alone_no_beat_of_the_auto_instrumentation_goes(tmp_path):
    r = run(ftsup("run", "--", str(BIN / "own_beats.py"), "--steps", "20"), cwd=tmp_path, env=ENV, timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    wanted = ("first_step_reached", "job_succeeded")
    steps = {e["event"]: e.get("step") for e in events(tmp_path) if e["event"] in wanted}
    assert steps == {"first_step_reached": 1001, "job_succeeded": 1020}  # never the optimizer's own 1, 2, ...
