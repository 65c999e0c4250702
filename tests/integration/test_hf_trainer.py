"""The HF Trainer example (`ftsup.trainer.examples.hf_gpt2`, FtsupCallback) under `ftsup run`.

A tiny transformers GPT-2 on 2 CPU ranks (gloo) with dropout, gradient clipping, cosine warmup
and an evaluation that lasts longer than the heartbeat timeout: the uninterrupted run is never
taken for a hang; a SIGKILLed rank then a SIGSTOPped one (one run), and an eviction (SIGTERM to the
supervisor, then `ftsup run` again) each end with a loss log bitwise equal to the uninterrupted one; the
final checkpoint, exported with `ftsup ckpt export-hf`, loads with `from_pretrained` and gives
the training model's logits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ftsup.store import layout
from ftsup.supervisor.policy.machine import EXIT_EVICTED
from ftsup.tools.faults import chaos
from tests.procs import PYTHONPATH, kill_tree, run, wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.long]

STEPS = 24
EVAL_PAD_S = 1.6  # each evaluation: longer than the heartbeat timeout in force (min_timeout_s, 3 x ~0.1 s steps)
MIN_TIMEOUT_S = 1.0
FAILURES = ("worker_exited", "heartbeat_timed_out", "progress_timed_out", "startup_timed_out")


def write_job(tmp: Path, *extra: str) -> Path:
    trainer = ["-m", "ftsup.trainer.examples.hf_gpt2", "--steps", str(STEPS), "--save-every", "4", "--eval-every", "7"]
    trainer += ["--eval-pad-s", str(EVAL_PAD_S), "--min-step-s", "0.1", "--loss-log", str(tmp / "loss.jsonl"), *extra]
    cfg = {
        "job": {
            "command": [sys.executable, *trainer],
            "workdir": str(tmp),
            "state_dir": str(tmp / "state"),
            "env": {"PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
        },
        "launch": {"nproc_per_node": 2},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "heartbeat": {"min_timeout_s": MIN_TIMEOUT_S},
        "restart": {"backoff_initial_s": 0.2, "stop_grace_s": 3},
        "eviction": {"signals": ["SIGTERM"], "default_deadline_s": 60, "save_margin_s": 2},
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ftsup_run(job: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    argv = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def events(tmp: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp / "state" / "logs" / "supervisor.jsonl").read_text().splitlines()]


def last_per_step(log: Path) -> dict[int, str]:
    return {j["step"]: j["loss_hex"] for j in map(json.loads, log.read_text().splitlines())}


def logged_step(log: Path) -> int:
    lines = log.read_text().splitlines() if log.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hf-ref")
    job = write_job(tmp, "--logits-out", str(tmp / "logits.pt"))
    r = run([sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config", str(job)], timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    return tmp


def test_an_uninterrupted_run_with_evaluations_longer_than_the_timeout_is_never_taken_for_a_hang(reference):
    seen = [e["event"] for e in events(reference)]
    assert [e for e in seen if e in FAILURES] == []
    assert seen.count("workers_launched") == 1
    assert sorted(last_per_step(reference / "loss.jsonl")) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("fault", ["kill-rank-1-then-stop-rank-0", "eviction"])
def test_a_fault_ends_with_the_uninterrupted_loss_log_bitwise(reference, tmp_path, fault):
    job = write_job(tmp_path)
    log = tmp_path / "loss.jsonl"
    proc = ftsup_run(job)
    try:
        wait_for(lambda: logged_step(log) >= 10 or proc.poll() is not None, 180, "step 10 never logged")
        assert proc.poll() is None
        if fault == "eviction":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == EXIT_EVICTED
            latest = layout.latest_consistent(tmp_path / "ckpt", deep=True)
            assert latest is not None and latest.step == logged_step(log)  # zero steps lost
            proc = ftsup_run(job)
        else:
            # One run, two faults: rank 1 SIGKILLed after step 10, then rank 0 of the relaunch SIGSTOPped after 18.
            ranks = chaos.wait_for_ranks(lambda: chaos.supervised_ranks(tmp_path / "state"), 2, 30)
            chaos.send(ranks[1], signal.SIGKILL)
            wait_for(lambda: logged_step(log) >= 18 or proc.poll() is not None, 180, "step 18 never logged")
            ranks = chaos.wait_for_ranks(lambda: chaos.supervised_ranks(tmp_path / "state"), 2, 30)
            chaos.send(ranks[0], signal.SIGSTOP)
        assert proc.wait(timeout=240) == 0
    finally:
        kill_tree(proc.pid)
    seen = [e["event"] for e in events(tmp_path)]
    want = [] if fault == "eviction" else ["worker_exited", "heartbeat_timed_out"]
    assert [e for e in seen if e in FAILURES] == want
    # Each relaunch went on from the checkpoint the supervisor chose, not from the start.
    resumes = [e["resume_step"] for e in events(tmp_path) if e["event"] == "workers_launched"][1:]
    assert len(resumes) == (1 if fault == "eviction" else 2) and all(r > 0 for r in resumes), resumes
    steps = [j["step"] for j in map(json.loads, log.read_text().splitlines())]
    resume = resumes[-1]
    head, tail = steps[: len(steps) - (STEPS - resume)], steps[len(steps) - (STEPS - resume) :]
    assert head[:10] == list(range(1, 11)) and tail == list(range(resume + 1, STEPS + 1))
    assert last_per_step(log) == last_per_step(reference / "loss.jsonl")


def test_export_hf_of_the_final_checkpoint_loads_with_from_pretrained_and_gives_the_training_logits(
    reference, tmp_path
):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    r = run([sys.executable, "-m", "ftsup.supervisor.cli", "ckpt", "export-hf", str(reference / "ckpt"), str(out)])
    assert r.returncode == 0, r.output
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = torch.load(reference / "logits.pt")
    with torch.no_grad():
        logits = model(torch.arange(trained.shape[1]).unsqueeze(0) % 256).logits
    assert torch.equal(logits, trained)


def test_a_run_resumed_from_its_final_checkpoint_takes_no_step_more(tmp_path):
    argv = [sys.executable, "-m", "ftsup.trainer.examples.hf_gpt2", "--steps", "3", "--save-every", "2"]
    argv += ["--eval-every", "100", "--output-dir", str(tmp_path / "out"), "--loss-log", str(tmp_path / "loss.jsonl")]
    for _ in range(2):  # one process, no supervisor: the second run resumes from the final checkpoint
        r = run(argv, timeout=180)
        assert r.returncode == 0, r.output[-3000:]
    assert [json.loads(x)["step"] for x in (tmp_path / "loss.jsonl").read_text().splitlines()] == [1, 2, 3]
