"""The rank-side guard in the reference trainer under plain torchrun (no supervisor): a NaN fault's
step applies no update and no checkpoint holds a non-finite tensor; data faults are keyed to data
positions, so a run that skips them from the start never meets them; every step's heartbeat
carries the figures the supervisor's detectors read."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ftsup.protocol import DATA_SKIPS_ENV, HEARTBEAT_SOCKET_ENV
from ftsup.store import layout
from ftsup.supervisor.run.heartbeat import HeartbeatReceiver
from tests.procs import run

pytestmark = pytest.mark.multiprocess

TINY = ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--corpus-bytes", "65536"]
TINY += ["--global-batch", "12", "--micro-batch", "2"]
G = 12


def gpt(tmp: Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None) -> list[dict]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    argv = [sys.executable, *(launcher if nproc > 1 else []), "-m", "ftsup.trainer.examples.gpt", *TINY]
    argv += ["--ckpt-dir", str(tmp / "ckpt"), "--loss-log", str(tmp / "loss.jsonl"), *args]
    r = run(argv, env=env, timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    return [json.loads(x) for x in (tmp / "loss.jsonl").read_text().splitlines()]


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a committed checkpoint, from every rank's shard."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("shard-*.safetensors")):
        out.update(load_file(str(shard)))
    return out


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> Path:
    """Two ranks, the first global batch skipped (FTSUP_DATA_SKIPS), a NaN on rank 1 at the
    positions step 4 serves without skips, which this run serves at step 3; a checkpoint a step."""
    tmp = tmp_path_factory.mktemp("nan")
    flags = ("--steps", "5", "--ckpt-every", "1", "--keep-last", "10", "--fault", "nan@4:1")
    gpt(tmp, *flags, env={DATA_SKIPS_ENV: f"0:{G}"})
    return tmp


def test_the_nan_fault_is_met_where_its_positions_are_served_and_that_step_is_refused(nan_run):
    log = [json.loads(x) for x in (nan_run / "loss.jsonl").read_text().splitlines()]
    refused = [(line["step"], math.isnan(line["loss"])) for line in log if line.get("step_skipped")]
    assert (refused, [line["samples"] for line in log]) == ([(3, True)], [2 * G, 3 * G, 4 * G, 5 * G, 6 * G])


def test_the_refused_step_applied_no_update_to_parameters_or_optimizer_state(nan_run):
    before, after = (tensors(nan_run / "ckpt" / layout.step_dirname(s)) for s in (2, 3))
    assert (before.keys() == after.keys(), [k for k in before if not torch.equal(before[k], after[k])]) == (True, [])


def test_the_steps_around_the_refused_one_did_update(nan_run):
    a, b = (tensors(nan_run / "ckpt" / layout.step_dirname(s)) for s in (3, 4))
    assert any(not torch.equal(a[k], b[k]) for k in a if ".model." in k)


def test_no_committed_checkpoint_holds_a_non_finite_tensor(nan_run):
    bad = [
        (c.name, name)
        for c in sorted((nan_run / "ckpt").glob("step-*"))
        for name, t in tensors(c).items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    assert (len(list((nan_run / "ckpt").glob("step-*"))), bad) == (5, [])


def test_the_skips_in_force_are_recorded_in_every_checkpoint(nan_run):
    recorded = [layout.read_manifest(c).metadata["data_skips"] for c in sorted((nan_run / "ckpt").glob("step-*"))]
    assert recorded == [[[0, G]]] * 5


def test_a_run_told_to_skip_the_poisoned_positions_from_the_start_never_meets_the_fault(tmp_path):
    log = gpt(
        tmp_path,
        "--steps",
        "5",
        "--ckpt-every",
        "5",
        "--fault",
        "nan@4:1",
        env={DATA_SKIPS_ENV: f"0:{G},{3 * G}:{4 * G}"},
    )
    assert ([line for line in log if line.get("step_skipped")], all(math.isfinite(x["loss"]) for x in log)) == (
        [],
        True,
    )


def test_a_spike_fault_drives_the_loss_far_up_for_its_window_only(tmp_path):
    log = gpt(tmp_path, "--steps", "6", "--ckpt-every", "6", "--fault", "spike@3:2", nproc=1)
    loss = [line["loss"] for line in log]
    assert [x > 5 * loss[1] for x in loss] == [False, False, True, True, False, False]


def test_a_run_that_skips_a_spikes_window_sees_no_spike(tmp_path):
    log = gpt(
        tmp_path, "--steps", "4", "--ckpt-every", "4", "--fault", "spike@3:2", "--skip", f"{2 * G}:{4 * G}", nproc=1
    )
    assert max(line["loss"] for line in log) < 2 * log[0]["loss"]


def test_every_step_beats_its_loss_grad_norm_data_position_and_own_work_and_a_refused_one_says_so(tmp_path):
    with HeartbeatReceiver(tmp_path / "run") as receiver:
        flags = ("--steps", "4", "--ckpt-every", "4", "--fault", "nan@2")
        gpt(tmp_path, *flags, nproc=1, env={HEARTBEAT_SOCKET_ENV: str(receiver.path)})
        beats = [b for b in receiver.drain() if b.phase == "train" and "step_s" in dict(b.figures)]
    got = [(b.step, sorted(dict(b.figures)), dict(b.figures)["samples"]) for b in beats]
    figures = ["compute_s", "grad_norm", "loss", "samples", "step_s"]
    assert got == [(1, figures, G), (2, [*figures, "step_skipped"], 2 * G), (3, figures, 3 * G), (4, figures, 4 * G)]


@pytest.mark.alone  # a ratio of two ranks' compute times: processes beside it on 2 cores narrow it
def test_a_slowed_rank_keeps_beating_and_its_own_work_figure_shows_it(tmp_path):
    with HeartbeatReceiver(tmp_path / "run") as receiver:
        flags = ("--steps", "10", "--ckpt-every", "10", "--fault", "slow@1:5", "--fault-attempt", "-1")
        gpt(tmp_path, *flags, env={HEARTBEAT_SOCKET_ENV: str(receiver.path)})
        beats = [b for b in receiver.drain() if b.phase == "train" and "step_s" in dict(b.figures)]
    own = {rank: statistics.median(dict(b.figures)["compute_s"] for b in beats if b.rank == rank) for rank in (0, 1)}
    assert ([b.step for b in beats if b.rank == 1], own[1] > 2 * own[0]) == (list(range(1, 11)), True)
