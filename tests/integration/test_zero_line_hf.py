"""A default Hugging Face Trainer script (`tests/bin/hf_default.py`: no line of ftsup, `trainer.train()` with no
resume point) under `ftsup run --nproc-per-node 2 -- ...`, no YAML file: the auto-instrumentation gives its Trainer
ftsup's callback, so that its checkpoints are committed in the store, and a rank SIGKILLed mid-run is relaunched from
the newest committed one with a per-step loss log bitwise the uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import layout
from ftsup.tools.faults import chaos
from tests.procs import BIN, PYTHONPATH, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess

STEPS, SAVE_EVERY, KILL_AFTER = 12, 4, 6


def supervise(workdir: Path, *, kill_after: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """`ftsup run` of the script on 2 ranks in `workdir`; rank 1 SIGKILLed once the loss log is past `kill_after`."""
    script = [str(BIN / "hf_default.py"), "--output-dir", "out", "--loss-log", "loss.jsonl"]
    script += ["--steps", str(STEPS), "--save-steps", str(SAVE_EVERY), "--pause-s", "0.2"]
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--nproc-per-node", "2"]
    argv += ["--restart-backoff-initial-s", "0.2", "--restart-stop-grace-s", "3", "--", *script]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
    with (workdir / "ftsup.out").open("w") as out:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        if kill_after is not None:
            output = lambda: (workdir / "ftsup.out").read_text()[-3000:]  # noqa: E731
            wait_for(lambda: len(logged(workdir)) > kill_after, 120, output)
            [node] = [p for p in (workdir / ".ftsup").iterdir() if (p / "journal.json").exists()]
            chaos.send(chaos.supervised_ranks(node)[1], signal.SIGKILL)
        code = proc.wait(timeout=180)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    [log] = (workdir / ".ftsup").glob("*/logs/supervisor.jsonl")
    assert code == 0, (workdir / "ftsup.out").read_text()[-3000:]
    return code, [json.loads(x) for x in log.read_text().splitlines()]


def logged(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "loss.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("hf-reference")
    supervise(workdir)
    return workdir


def losses(workdir: Path) -> dict[int, str]:
    return {x["step"]: x["loss_hex"] for x in logged(workdir)}


def test_the_default_trainers_checkpoints_are_committed_in_the_store(uninterrupted):
    committed = layout.list_checkpoints(uninterrupted / ".ftsup" / "checkpoints")
    assert ([c.step for c in committed], sorted(losses(uninterrupted))) == (
        list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)),
        list(range(1, STEPS + 1)),
    )


def test_a_sigkilled_rank_resumes_from_the_newest_committed_checkpoint_with_the_uninterrupted_losses(
    uninterrupted, tmp_path
):
    _, events = supervise(tmp_path, kill_after=KILL_AFTER)
    launched = [e["resume_step"] for e in events if e["event"] == "workers_launched"]
    chosen = [e["step"] for e in events if e["event"] == "checkpoint_chosen"][:2]
    if len(launched) == 3:  # a resumed rank that aborted in the interpreter's exit, its last step done: see below
        last = [e for e in events if e["event"] == "worker_exited"][-1]
        assert (last["signal"], last["step"], launched[2]) == ("SIGABRT", STEPS, STEPS), last
    first, resume = launched[:2]
    steps = [x["step"] for x in logged(tmp_path)]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert (first, chosen, resume % SAVE_EVERY, steps[restart:]) == (
        None,
        [None, resume],
        0,
        list(range(resume + 1, STEPS + 1)),
    )
    assert SAVE_EVERY <= resume <= steps[restart - 1]  # progress kept: the Trainer's own restart was from step 0
    assert losses(tmp_path) == losses(uninterrupted)


# A rank of the resumed attempt has been seen to abort after its last step, in the interpreter's exit ("terminate
# called without an active exception", no Python frame left), about once in six runs on two busy cores: its relaunch
# resumes from the final checkpoint and takes no step. The claims above are about the kill and the resume.
