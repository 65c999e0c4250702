"""The nanoGPT-style script against its baseline, whose uninterrupted run under plain torchrun is the reference: the
adopted script logs the reference's losses and evaluations bitwise after a SIGKILLed rank, a SIGSTOPped rank and an
eviction under `ftsup run --nproc-per-node 2 -- python SCRIPT`, killed under plain torchrun (resumed from
`./.ftsup/checkpoints`), and run by plain python then continued by `ftsup run` from the same directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ftsup.store import layout
from ftsup.supervisor.policy.machine import EXIT_EVICTED
from ftsup.tools.faults import chaos
from ftsup.trainer.examples import corpus
from tests.procs import PYTHONPATH, REPO, kill_tree, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

BASELINE, ADOPTED = REPO / "trainer/examples/nanogpt_baseline.py", REPO / "trainer/examples/nanogpt.py"
MAX_ITERS, EVAL_INTERVAL, FAULT_AFTER = 15, 4, 6  # iterations 0..15; checkpoints of 4, 8, 12 steps and the final 16
PACED = ["--min_iter_s=0.25"]  # so that a fault lands mid-run
FAILURES = ("worker_exited", "heartbeat_timed_out", "progress_timed_out", "startup_timed_out")
# `python` as the ranks find it on PATH: this interpreter, the one with torch.
ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
FAST = ["--restart-backoff-initial-s", "0.2", "--restart-stop-grace-s", "3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """uint16 tokens in train.bin and val.bin, as nanoGPT's prepare.py writes them."""
    folder = tmp_path_factory.mktemp("data")
    tokens = corpus.generate(1 << 16).numpy().astype(np.uint16)
    tokens[:60_000].tofile(folder / "train.bin")
    tokens[60_000:].tofile(folder / "val.bin")
    return folder


def settings(work: Path, data: Path, max_iters: int = MAX_ITERS) -> list[str]:
    return [
        f"--max_iters={max_iters}",
        f"--eval_interval={EVAL_INTERVAL}",
        "--eval_iters=2",
        f"--data_dir={data}",
        f"--out_dir={work / 'out'}",
        f"--loss_log={work / 'loss.jsonl'}",
    ]


def hexes(work: Path) -> dict[int, dict[str, Any]]:
    """Each iteration's last line: its loss and, where rank 0 evaluated, the evaluation's, as float.hex."""
    return {
        s: {k: v for k, v in j.items() if k.endswith("_hex")}
        for s, j in chaos.last_line_per_step(work / "loss.jsonl").items()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data: Path) -> dict[int, dict[str, Any]]:
    work = tmp_path_factory.mktemp("baseline")
    r = run([*TORCHRUN, str(BASELINE), *settings(work, data)], env=ENV, cwd=work, timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    got = hexes(work)
    assert (sorted(got), "val_hex" in got[EVAL_INTERVAL]) == (list(range(MAX_ITERS + 1)), True)
    return got


def start(argv: list[str], work: Path) -> subprocess.Popen[bytes]:
    with (work / "out.log").open("wb") as out:
        return subprocess.Popen(
            argv,
            cwd=work,
            env=dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **ENV),
            stdout=out,
            stderr=out,
        )


def until_iteration(proc: subprocess.Popen[bytes], work: Path, then: Callable[[], None]) -> int:
    """Wait for the loss log to pass iteration FAULT_AFTER, do `then`, and return the process's exit status."""
    try:
        with chaos.LossLogTail(work / "loss.jsonl") as tail:
            tail.wait_for_step(FAULT_AFTER, 120)
            then()
        return proc.wait(timeout=180)
    finally:
        kill_tree(proc.pid)


def test_killed_under_plain_torchrun_it_resumes_from_its_default_store_bitwise(reference, data, tmp_path):
    argv = [*TORCHRUN, str(ADOPTED), *settings(tmp_path, data), *PACED]
    proc = start(argv, tmp_path)
    code = until_iteration(proc, tmp_path, lambda: chaos.send(chaos.ranks_under(proc.pid)[1], signal.SIGKILL))
    assert code != 0
    r = run(argv, env=ENV, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    assert "step=4" in r.output or "step=8" in r.output  # checkpoint_loaded: a periodic save before the kill
    assert hexes(tmp_path) == reference  # the steps before the kill too: adopting the Session changes no loss
    committed = [c.step for c in layout.list_checkpoints(tmp_path / ".ftsup" / "checkpoints")]
    assert committed[-1] == MAX_ITERS + 1  # the final checkpoint: every iteration, 0 to MAX_ITERS


def supervise(work: Path, data: Path) -> list[str]:
    command = ["python", str(ADOPTED), *settings(work, data), *PACED]
    return [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--nproc-per-node", "2", *FAST, "--", *command]


def events(work: Path) -> list[dict[str, Any]]:
    [log] = (work / ".ftsup").glob("*/logs/supervisor.jsonl")
    return [json.loads(line) for line in log.read_text().splitlines()]


def signal_rank_1(work: Path, sig: int) -> Callable[[], None]:
    def send() -> None:
        [state] = [p.parents[1] for p in (work / ".ftsup").glob("*/logs/supervisor.jsonl")]
        chaos.send(chaos.supervised_ranks(state)[1], sig)

    return send


def test_under_ftsup_run_a_sigkilled_then_a_sigstopped_rank_is_relaunched_and_the_loss_log_is_the_baselines(
    reference, data, tmp_path
):
    # One run, two faults: rank 1 SIGKILLed after iteration 6, then the relaunch's rank 1 SIGSTOPped after 10.
    def kill_then_stop() -> None:
        signal_rank_1(tmp_path, signal.SIGKILL)()
        with chaos.LossLogTail(tmp_path / "loss.jsonl") as tail:
            tail.wait_for_step(FAULT_AFTER + 4, 120)  # the killed attempt stops near iteration 6: this is the relaunch
        signal_rank_1(tmp_path, signal.SIGSTOP)()

    code = until_iteration(start(supervise(tmp_path, data), tmp_path), tmp_path, kill_then_stop)
    assert code == 0, (tmp_path / "out.log").read_text()[-3000:]
    caught = [e["event"] for e in events(tmp_path) if e["event"] in FAILURES]
    assert (caught, hexes(tmp_path)) == (["worker_exited", "heartbeat_timed_out"], reference)


def test_an_eviction_saves_exits_5_and_the_next_run_finishes_bitwise_the_baselines(reference, data, tmp_path):
    proc = start(supervise(tmp_path, data), tmp_path)
    assert until_iteration(proc, tmp_path, lambda: proc.send_signal(signal.SIGTERM)) == EXIT_EVICTED
    latest = layout.latest_consistent(tmp_path / ".ftsup" / "checkpoints", deep=True)
    last_logged = max(hexes(tmp_path))
    # No iteration lost: the newest checkpoint is the step the ranks were on (a periodic save of that very step, if one
    # was on its way, supersedes the emergency one).
    kind = "periodic" if (last_logged + 1) % EVAL_INTERVAL == 0 else "emergency"
    assert (latest.step, latest.kind) == (last_logged + 1, kind)
    r = run(supervise(tmp_path, data), env=ENV, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    assert hexes(tmp_path) == reference


def test_run_by_plain_python_to_the_end_it_is_continued_by_ftsup_run_from_the_same_directory_bitwise(data, tmp_path):
    baseline, adopted = tmp_path / "baseline", tmp_path / "adopted"
    for work in (baseline, adopted):
        work.mkdir()
    r = run([sys.executable, str(BASELINE), *settings(baseline, data, 11)], env=ENV, cwd=baseline)
    assert r.returncode == 0, r.output[-3000:]
    r = run([sys.executable, str(ADOPTED), *settings(adopted, data, 7)], env=ENV, cwd=adopted)
    assert r.returncode == 0, r.output[-3000:]
    more = ["python", str(ADOPTED), *settings(adopted, data, 11)]  # the final checkpoint and 4 iterations more
    r = run([sys.executable, "-m", "ftsup.supervisor.cli", "run", *FAST, "--", *more], env=ENV, cwd=adopted)
    assert r.returncode == 0, r.output[-3000:]
    launched = [e["resume_step"] for e in events(adopted) if e["event"] == "workers_launched"]
    assert (launched, hexes(adopted)) == ([8], hexes(baseline))


def test_a_long_evaluation_by_rank_0_alone_is_no_hang_while_rank_1_waits_in_its_next_collective(data, tmp_path):
    # Evaluations at iterations 0 and 8, each far longer than an iteration's heartbeat timeout; rank 1 sends no beat
    # while it waits in the gradient all-reduce of the iteration that follows.
    command = ["python", str(ADOPTED), *settings(tmp_path, data), *PACED, "--eval_interval=8", "--min_eval_s=6.0"]
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--nproc-per-node", "2", *FAST, "--", *command]
    r = run(argv, env=ENV, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    logged = chaos.last_line_per_step(tmp_path / "loss.jsonl")
    assert ([e["event"] for e in events(tmp_path) if e["event"] in FAILURES], sorted(logged)) == (
        [],
        list(range(MAX_ITERS + 1)),
    )
