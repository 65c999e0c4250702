"""A DeepSpeed script without a line of ftsup (`tests/bin/deepspeed_default.py`: its own loop, ZeRO on gloo with
DeepSpeed's CPU accelerator, 2 ranks, `save_checkpoint` every 3 steps, `load_checkpoint` at the start) under `ftsup run
--nproc-per-node 2 -- ...`: each tag it saves is committed in the store once every rank has written it; a tag torn
by a kill in its save (a rank's file cut short, `latest` naming it) is never resumed, and a rank SIGKILLed later in
that run is relaunched from the newest committed tag with the losses of a run that never stopped; a rank SIGSTOPped
is caught as a hang from the engine's steps (ZeRO-3) and the job resumes; an eviction gets an emergency save of the
step reached."""

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
from ftsup.supervisor.policy.machine import EXIT_EVICTED, EXIT_SAVE_LOST
from ftsup.tools.faults import chaos
from tests.procs import BIN, PYTHONPATH, free_port, kill_tree, run, wait_for

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

STEPS, EVERY = 12, 3
ENV = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")


def script(stage: int, steps: int = STEPS) -> list[str]:
    argv = [str(BIN / "deepspeed_default.py"), "--loss-log", "loss.jsonl", "--save-dir", "ds", "--stage", str(stage)]
    return [*argv, "--steps", str(steps), "--save-every", str(EVERY), "--pause-s", "0.3"]


def supervise(
    workdir: Path,
    stage: int,
    *,
    kill_after: int | None = None,
    evict_after: int | None = None,
    code: int = 0,
    kill: signal.Signals = signal.SIGKILL,
    flags: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """`ftsup run` of the script on 2 ranks in `workdir`; rank 1 sent `kill` once the loss log is past `kill_after`, or
    the supervisor sent SIGTERM (an eviction notice) once it is past `evict_after`; its exit status must be `code`."""
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--nproc-per-node", "2", *flags]
    argv += ["--restart-backoff-initial-s", "0.2", "--restart-stop-grace-s", "3", "--", *script(stage), *extra]
    with (workdir / "ftsup.out").open("w") as out:
        proc = subprocess.Popen(argv, cwd=workdir, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    output = lambda: (workdir / "ftsup.out").read_text()[-3000:]  # noqa: E731
    try:
        if kill_after is not None:
            wait_for(lambda: len(logged(workdir)) > kill_after, 180, output)
            [node] = [p for p in (workdir / ".ftsup").iterdir() if (p / "journal.json").exists()]
            chaos.send(chaos.supervised_ranks(node)[1], kill)
        if evict_after is not None:
            wait_for(lambda: len(logged(workdir)) > evict_after, 180, output)
            proc.send_signal(signal.SIGTERM)
        ended = proc.wait(timeout=240)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    assert ended == code, output()
    [log] = (workdir / ".ftsup").glob("*/logs/supervisor.jsonl")
    return [json.loads(x) for x in log.read_text().splitlines()]


def logged(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "loss.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def losses(workdir: Path) -> dict[int, str]:
    return {x["step"]: x["loss_hex"] for x in logged(workdir)}


def rank_output(workdir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((workdir / ".ftsup").glob("*/logs/attempt-*.log")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("deepspeed-reference")
    supervise(workdir, 2)
    return workdir


def test_each_tag_the_script_saves_is_committed_in_the_store(uninterrupted):
    committed = layout.list_checkpoints(uninterrupted / ".ftsup" / "checkpoints")
    formats = {layout.read_manifest(c.path).metadata["format"] for c in committed}
    assert ([c.step for c in committed][-1], formats, sorted(losses(uninterrupted))) == (
        STEPS,
        {"deepspeed"},
        list(range(1, STEPS + 1)),
    )


def test_the_store_converts_to_the_hub_layout_as_zero_to_fp32_consolidates_its_newest_tag(uninterrupted, tmp_path):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from ftsup.supervisor.cli.commands import main

    store = uninterrupted / ".ftsup" / "checkpoints"
    assert main(["ckpt", "import-deepspeed", str(store), str(tmp_path / "hf")]) == 0
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = get_fp32_state_dict_from_zero_checkpoint(str(store), tag=layout.step_dirname(STEPS))
    assert (sorted(got), [k for k in want if not torch.equal(got[k], want[k])]) == (sorted(want), [])


def test_a_torn_tag_that_latest_names_is_passed_over_for_the_newest_whole_one(uninterrupted, tmp_path):
    # The script's own checkpoints from before ftsup: global_step3 and global_step6, then global_step6 torn as a kill
    # in its save leaves it (DeepSpeed's rank 0 writes `latest` without waiting for the other ranks' files).
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    r = run([*argv, *script(2, steps=6)], cwd=tmp_path, env={"DS_ACCELERATOR": "cpu"}, timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    assert (tmp_path / "ds" / "latest").read_text() == "global_step6"
    torn = tmp_path / "ds" / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(torn, torn.stat().st_size // 2)
    (tmp_path / "loss.jsonl").unlink()
    supervise(tmp_path, 2)
    assert (min(losses(tmp_path)), losses(tmp_path)) == (4, {s: h for s, h in losses(uninterrupted).items() if s > 3})
    assert "deepspeed_tag_passed_over" in rank_output(tmp_path)
    assert "global_step6" in rank_output(tmp_path)


def test_an_eviction_saves_the_step_reached_and_the_next_run_goes_on_from_it(tmp_path):
    supervise(tmp_path, 2, evict_after=4, code=EXIT_EVICTED)
    saved = layout.latest_consistent(tmp_path / ".ftsup" / "checkpoints", deep=True)
    reached = max(x["step"] for x in logged(tmp_path))
    assert saved is not None and (saved.step, saved.kind) == (reached, "emergency")  # no step lost
    events = supervise(tmp_path, 2)
    [resume] = [e["resume_step"] for e in events if e["event"] == "workers_launched"][-1:]
    steps = [x["step"] for x in logged(tmp_path)]
    assert (resume, steps) == (reached, list(range(1, STEPS + 1)))  # each step once


def test_a_sigstopped_zero3_rank_is_caught_as_a_hang_by_its_engine_steps_and_the_job_resumes(tmp_path):
    events = supervise(tmp_path, 3, kill_after=7, kill=signal.SIGSTOP, flags=("--heartbeat-min-timeout-s", "2"))
    [hang] = [e for e in events if e["event"] == "heartbeat_timed_out"]
    resumes = [e["resume_step"] for e in events if e["event"] == "workers_launched"]
    steps = [x["step"] for x in logged(tmp_path)]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert (hang["attempt"], hang["rank"], len(resumes), resumes[1] % EVERY) == (1, 1, 2, 0), hang
    assert (resumes[1] >= EVERY, steps[restart:]) == (True, list(range(resumes[1] + 1, STEPS + 1)))


def test_an_eviction_of_a_script_keeping_its_step_in_client_state_is_not_saved_stale(tmp_path):
    events = supervise(tmp_path, 2, evict_after=4, code=EXIT_SAVE_LOST, extra=("--client-state",))
    saved = layout.latest_consistent(tmp_path / ".ftsup" / "checkpoints", deep=True)
    reached = max(x["step"] for x in logged(tmp_path))
    assert saved is not None and (saved.kind, saved.step % EVERY, saved.step <= reached) == ("periodic", 0, True)
    [failed] = [e for e in events if e["event"] == "emergency_save_failed"]
    assert (failed["checkpoint_step"], "emergency_save_skipped" in rank_output(tmp_path)) == (saved.step, True)


def test_a_kill_in_the_first_save_leaves_a_torn_tag_never_resumed_and_a_later_kill_resumes_the_newest_tag(
    uninterrupted, tmp_path
):
    # Rank 1 dies halfway through its optimizer states of step 3; rank 0 has written its files and `latest` naming the
    # torn tag (as DeepSpeed does), the store has nothing: the relaunch must start afresh, not from the torn tag. Rank 1
    # of the relaunch is then SIGKILLed past step 7: the third attempt resumes from the newest committed tag.
    events = supervise(tmp_path, 2, kill_after=EVERY + 7, extra=("--die-in-save", str(EVERY)))
    launched = [e["resume_step"] for e in events if e["event"] == "workers_launched"]
    steps = [x["step"] for x in logged(tmp_path)]
    resume = launched[-1]
    again = len(steps) - (STEPS - resume)
    assert (launched[:2], resume % EVERY, steps[:EVERY]) == ([None, None], 0, list(range(1, EVERY + 1))), launched
    second, third = steps[EVERY:again], steps[again:]
    assert (second, third) == (list(range(1, again - EVERY + 1)), list(range(resume + 1, STEPS + 1)))
    assert EVERY <= resume <= again - EVERY  # progress kept
    assert losses(tmp_path) == losses(uninterrupted)
    [log] = (tmp_path / ".ftsup").glob("*/logs/attempt-0002.log")
    passed = log.read_text().split("deepspeed_tag_passed_over", 1)[1][:400]
    assert ((tmp_path / "died-in-save").exists(), f"global_step{EVERY}/zero_pp_rank_1_mp" in passed) == (True, True)
