"""Restoring from the durable tier on a real S3 store (SeaweedFS on 127.0.0.1): the engine reads a checkpoint the
local store lacks straight from the tier, each rank its share (resharded), every block verified; a flipped byte in
a durable file is caught, naming the object, and the previous durable checkpoint is loaded; `ftsup run` on a machine
whose fast tier is empty resumes from the tier, bitwise as the uninterrupted run (ftsup/store/DESIGN.md, "Durable
tier")."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import structlog
import torch
import yaml

from ftsup.protocol import DURABLE_TIER_ENV
from ftsup.store import durable, layout
from ftsup.trainer.checkpoint import CheckpointEngine
from ftsup.trainer.checkpoint.stateful import ModelOptimState
from tests.procs import PYTHONPATH, REPO, free_port, run, torchrun
from tests.s3fixtures import client
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.multiprocess


def make_state(seed: int) -> ModelOptimState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return ModelOptimState(model, optim)


def weights(state: ModelOptimState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def upload_all(url: str, root: Path) -> list[int]:
    with durable.open_tier(url) as tier:
        return [tier.upload(path).step for _, path in layout.committed_dirs(root)]


def test_a_flipped_byte_in_a_durable_file_is_caught_naming_the_object_and_the_previous_one_is_loaded(
    bucket: str, tmp_path: Path, s3_server: SeaweedS3
) -> None:
    url = f"s3://{bucket}/run"
    saved = {}
    with CheckpointEngine(tmp_path / "fast", durable_tier=None) as engine:
        for step in (1, 2):
            state = make_state(step)
            engine.save(step, {"app": state}, block=True)
            saved[step] = weights(state)
    upload_all(url, tmp_path / "fast")
    with durable.open_tier(url) as tier:
        key = f"run/step-000000002/{durable.data_token(tier.manifest(2)[1])}/shard-00000.safetensors"
    s3 = client(s3_server)
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) - 10] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    fresh = make_state(99)
    with structlog.testing.capture_logs() as logs, CheckpointEngine(tmp_path / "new-vm", durable_tier=url) as engine:
        loaded = engine.load({"app": fresh})
    assert (loaded.step, loaded.tier, loaded.path) == (1, "durable", f"{url}/step-000000001")
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), saved[1], strict=True))
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert [(e["step"], f"s3://{bucket}/{key}: checksum mismatch" in e["reason"]) for e in skipped] == [(2, True)]
    assert not any((tmp_path / "new-vm").glob("step-*"))  # read from the tier, nothing written locally


def test_a_checkpoint_only_a_shared_filesystem_tier_holds_loads_from_it_bitwise(tmp_path: Path) -> None:
    state = make_state(7)
    with CheckpointEngine(tmp_path / "fast", durable_tier=None) as engine:
        engine.save(3, {"app": state}, rank_state={"rank": 0, "data": 42}, block=True)
    url = str(tmp_path / "shared")
    upload_all(url, tmp_path / "fast")
    fresh = make_state(99)
    with CheckpointEngine(tmp_path / "new-vm", durable_tier=url) as engine:
        loaded = engine.load({"app": fresh})
    assert (loaded.step, loaded.tier, loaded.rank_state) == (3, "durable", {"rank": 0, "data": 42})
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), weights(state), strict=True))


def test_a_step_asked_for_that_only_the_durable_tier_holds_consistent_loads_from_it(tmp_path: Path) -> None:
    states = {step: make_state(step) for step in (1, 2)}
    with CheckpointEngine(tmp_path / "fast", durable_tier=None) as engine:
        for step, state in states.items():
            engine.save(step, {"app": state}, block=True)
    url = str(tmp_path / "shared")
    upload_all(url, tmp_path / "fast")
    (tmp_path / "fast" / "step-000000001" / "shard-00000.safetensors").write_bytes(b"torn")
    fresh = make_state(99)
    with CheckpointEngine(tmp_path / "fast", durable_tier=url) as engine:
        loaded = engine.load({"app": fresh}, step=1)
    assert (loaded.step, loaded.tier) == (1, "durable")
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), weights(states[1]), strict=True))


def test_a_durable_tier_that_cannot_be_reached_leaves_the_local_stores_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = free_port()  # nothing listens there: every connection is refused
    env = {
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{closed}",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    with CheckpointEngine(tmp_path / "fast", durable_tier="s3://bucket/run") as engine:
        engine.save(1, {"app": make_state(1)}, block=True)
        with structlog.testing.capture_logs() as logs:
            loaded = engine.load({"app": make_state(99)})
    assert (loaded.step, loaded.tier) == (1, "fast")
    assert [e["event"] for e in logs if e["event"] == "durable_choice_failed"] == ["durable_choice_failed"]


@pytest.fixture(scope="module")
def fsdp_in_the_tier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 2-rank FSDP2 checkpoint (steps 1 and 2) in a local store, and what was saved."""
    base = tmp_path_factory.mktemp("fsdp")
    out = base / "save.json"
    save = ["save", "--dir", str(base / "ckpt"), "--parallel", "fsdp", "--width", "1024", "--steps", "1,2"]
    r = torchrun("ckpt_worker.py", [*save, "--out", str(out)], nproc=2)
    assert r.returncode == 0, r.output[-4000:]
    return base / "ckpt", json.loads(out.read_text())


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_2_rank_save_loads_resharded_from_the_durable_tier_each_rank_reading_its_share(
    fsdp_in_the_tier, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int
) -> None:
    ckpt, saved = fsdp_in_the_tier
    url = f"s3://{bucket}/job"
    assert upload_all(url, ckpt) == [1, 2]
    monkeypatch.setenv(DURABLE_TIER_ENV, url)
    out = tmp_path / "load.json"
    r = torchrun(
        "ckpt_worker.py",
        ["load", "--dir", str(tmp_path / "empty"), "--parallel", "fsdp", "--width", "1024", "--out", str(out)],
        nproc=nproc,
    )
    assert r.returncode == 0, r.output[-4000:]
    loaded = json.loads(out.read_text())
    assert (loaded["step"], loaded["saved_world_size"], loaded["digests"]) == (2, 2, saved["digests_2"])
    manifest = layout.read_manifest(ckpt / "step-000000002")
    meta = json.loads((ckpt / "step-000000002" / layout.DCP_META_NAME).read_bytes())
    sidecars = sum(e.size for rel, e in manifest.files.items() if rel.endswith(".crc32"))
    states = max(e.size for rel, e in manifest.files.items() if rel.startswith("rank-"))
    # Each rank's share of the tensors, plus at most a checksum block on either side of each region it reads.
    padding = 2 * layout.CHECKSUM_BLOCK_BYTES * len(meta["storage"])
    bound = -(-manifest.tensor_bytes // nproc) + padding + sidecars + states
    print(f"bytes read per rank, {nproc} of {manifest.tensor_bytes} saved: {loaded['bytes_read']} (bound {bound})")
    assert all(b <= bound for b in loaded["bytes_read"])
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").glob("step-*"))


STEPS = 12
SMALL_MODEL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "32", "--corpus-bytes", "200000"]
TRAINER = ["-m", "ftsup.trainer.examples.gpt", "--steps", str(STEPS), "--ckpt-every", "3", "--keep-last", "10"]
TRAINER += SMALL_MODEL


def job(tmp: Path, name: str, env: dict[str, str]) -> Path:
    cfg = {
        "job": {
            "command": [sys.executable, *TRAINER, "--loss-log", str(tmp / f"{name}.jsonl")],
            "workdir": str(REPO),
            "state_dir": str(tmp / name / "state"),
            "env": {"PYTHONPATH": PYTHONPATH, **env},
        },
        "launch": {"nproc_per_node": 1},
        "checkpoint": {"dir": str(tmp / name / "ckpt")},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(log: Path) -> dict[int, str]:
    return {j["step"]: j["loss_hex"] for j in map(json.loads, log.read_text().splitlines())}


def test_ftsup_run_on_a_machine_whose_fast_tier_is_empty_resumes_from_the_durable_tier_bitwise(
    bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/gpt"
    ftsup_run = [sys.executable, "-m", "ftsup.supervisor.cli", "run", "--config"]
    first = run([*ftsup_run, str(job(tmp_path, "old-vm", {}))], timeout=120)
    assert first.returncode == 0, first.output[-3000:]
    with durable.open_tier(url) as tier:
        tier.upload(tmp_path / "old-vm" / "ckpt" / layout.step_dirname(6))
    shutil.rmtree(tmp_path / "old-vm")  # the machine is gone, with its fast tier and its state directory
    second = run([*ftsup_run, str(job(tmp_path, "new-vm", {DURABLE_TIER_ENV: url}))], timeout=120)
    assert second.returncode == 0, second.output[-3000:]
    uninterrupted, resumed = losses(tmp_path / "old-vm.jsonl"), losses(tmp_path / "new-vm.jsonl")
    assert sorted(resumed) == list(range(7, STEPS + 1))
    assert resumed == {s: h for s, h in uninterrupted.items() if s > 6}
