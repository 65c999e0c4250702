"""FSDP2 on a one-GPU NCCL mesh, saved by the engine while training goes on, loads bitwise at world sizes 1 and 2
on CPU and gloo (`tests/bin/ckpt_worker.py load`): the checkpoint reshards across devices and world sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.procs import torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("cuda-fsdp2")
    r = torchrun("cuda_fsdp_rank.py", ["--dir", str(base / "ckpt"), "--out", str(base / "save.json")], nproc=1)
    assert r.returncode == 0, r.output[-4000:]
    return base / "ckpt", json.loads((base / "save.json").read_text())


@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp2_saved_on_one_gpu_loads_bitwise_on_n_cpu_ranks(saved: tuple[Path, dict], tmp_path: Path, nproc: int):
    ckpt, at_save = saved
    out = tmp_path / "load.json"
    r = torchrun("ckpt_worker.py", ["load", "--dir", str(ckpt), "--parallel", "fsdp", "--out", str(out)], nproc=nproc)
    assert r.returncode == 0, r.output[-4000:]
    loaded = json.loads(out.read_text())
    assert (loaded["step"], loaded["saved_world_size"], loaded["digests"]) == (2, 1, at_save["digests"])


def test_training_went_on_during_the_save_and_the_agreement_ran_beside_nccl(saved: tuple[Path, dict]) -> None:
    _, at_save = saved
    assert (at_save["changed_after"], at_save["agreed_seq"]) == (True, 0)
