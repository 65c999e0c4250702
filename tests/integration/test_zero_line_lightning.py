"""A Lightning script without a line of ftsup (`tests/bin/lightning_default.py`: DDP on gloo, 2 processes, the
default checkpoints at the end of each epoch, `trainer.fit` with no checkpoint) under `ftsup run --nproc-per-node 2
-- ...`, no YAML file: the auto-instrumentation gives its Trainer ftsup's callback, which commits each checkpoint the
Trainer saves in the store with each rank's random streams, and a rank SIGKILLed mid-epoch is relaunched from the
newest committed one with a per-step loss log bitwise the uninterrupted run's. An eviction mid-epoch gets an emergency
save of the step reached, and the next run goes on from it (Lightning then starts the epoch's data again: not
bitwise, docs/lightning.md)."""

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
from ftsup.supervisor.policy.machine import EXIT_EVICTED
from ftsup.tools.faults import chaos
from tests.procs import BIN, PYTHONPATH, kill_tree, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

EPOCHS, PER_EPOCH, KILL_AFTER = 3, 8, 10  # 64 windows, 4 a batch, 2 ranks: 8 optimizer steps an epoch


def supervise(
    workdir: Path, *, kill_after: int | None = None, evict_after: int | None = None, code: int = 0
) -> list[dict[str, Any]]:
    """`ftsup run` of the script on 2 ranks in `workdir`; rank 1 SIGKILLed once the loss log is past `kill_after`, or
    the supervisor sent SIGTERM (an eviction notice) once it is past `evict_after`; its exit status must be `code`."""
    script = [str(BIN / "lightning_default.py"), "--loss-log", "loss.jsonl", "--root", "root"]
    script += ["--epochs", str(EPOCHS), "--pause-s", "0.2"]
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
        if evict_after is not None:
            output = lambda: (workdir / "ftsup.out").read_text()[-3000:]  # noqa: E731
            wait_for(lambda: len(logged(workdir)) > evict_after, 120, output)
            proc.send_signal(signal.SIGTERM)
        ended = proc.wait(timeout=180)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    [log] = (workdir / ".ftsup").glob("*/logs/supervisor.jsonl")
    assert ended == code, (workdir / "ftsup.out").read_text()[-3000:]
    return [json.loads(x) for x in log.read_text().splitlines()]


def logged(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "loss.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def losses(workdir: Path) -> dict[int, str]:
    return {x["step"]: x["loss_hex"] for x in logged(workdir)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("lightning-reference")
    supervise(workdir)
    return workdir


def test_each_checkpoint_the_trainer_saves_is_committed_in_the_store(uninterrupted):
    committed = layout.list_checkpoints(uninterrupted / ".ftsup" / "checkpoints")
    assert ([c.step for c in committed], sorted(losses(uninterrupted))) == (
        list(range(PER_EPOCH, EPOCHS * PER_EPOCH + 1, PER_EPOCH)),
        list(range(1, EPOCHS * PER_EPOCH + 1)),
    )


def test_a_sigkilled_rank_resumes_from_the_newest_committed_checkpoint_with_the_uninterrupted_losses(
    uninterrupted, tmp_path
):
    events = supervise(tmp_path, kill_after=KILL_AFTER)
    [first, resume] = [e["resume_step"] for e in events if e["event"] == "workers_launched"]
    steps = [x["step"] for x in logged(tmp_path)]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert (first, resume % PER_EPOCH, steps[restart:]) == (None, 0, list(range(resume + 1, EPOCHS * PER_EPOCH + 1)))
    assert PER_EPOCH <= resume <= steps[restart - 1]  # progress kept: the script alone would start again at step 1
    assert losses(tmp_path) == losses(uninterrupted)


def test_an_eviction_mid_epoch_saves_the_step_reached_and_the_next_run_goes_on_from_it(tmp_path):
    supervise(tmp_path, evict_after=KILL_AFTER, code=EXIT_EVICTED)
    saved = layout.latest_consistent(tmp_path / ".ftsup" / "checkpoints", deep=True)
    reached = max(x["step"] for x in logged(tmp_path))
    assert saved is not None and (saved.step, saved.kind) == (reached, "emergency")  # no step lost
    events = supervise(tmp_path)
    [resume] = [e["resume_step"] for e in events if e["event"] == "workers_launched"][-1:]
    assert (resume, max(losses(tmp_path))) == (reached, EPOCHS * PER_EPOCH)
