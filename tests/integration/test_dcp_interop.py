"""DCP both ways, with real `torch.distributed.checkpoint`: a checkpoint two FSDP2 ranks saved (torchtitan's layout)
starts a run on one rank and on three, every tensor bitwise and each rank reading exactly its share, with the same
first loss; an ftsup checkpoint exported by `ftsup ckpt export-dcp` loads with `dcp.load` on one rank and on three,
bitwise, the export holding no more than the largest tensor plus 256 MiB in memory; bad input loads nothing."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftsup.store import layout
from ftsup.store.errors import ModelFileError
from ftsup.supervisor.cli.commands import main
from ftsup.trainer.dcp.load import load_dcp_model
from ftsup.trainer.examples.gpt import GPT
from tests.procs import run, torchrun

SHAPE = {"seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}  # tests/bin/dcp_save_worker.py's


def digests(sd: dict[str, Any]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in sd.items()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What tests/bin/dcp_save_worker.py wrote on two FSDP2 ranks, an export of its ftsup checkpoint by the command
    line, and what tests/bin/dcp_load_worker.py read of both on three FSDP2 ranks."""
    tmp = tmp_path_factory.mktemp("dcp")
    r = torchrun("dcp_save_worker.py", ["--out", str(tmp)], nproc=2, timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    assert main(["ckpt", "export-dcp", str(tmp / "ftsup"), str(tmp / "export")]) == 0
    args = ["--dcp", str(tmp / "dcp"), "--export", str(tmp / "export"), "--out", str(tmp / "rank")]
    r = torchrun("dcp_load_worker.py", args, nproc=3, timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    ranks = [json.loads((tmp / f"rank.{i}.json").read_text()) for i in range(3)]
    return {"dir": tmp, "ref": json.loads((tmp / "ref.json").read_text()), "ranks": ranks}


@pytest.mark.multiprocess
def test_three_fsdp2_ranks_start_from_two_ranks_dcp_checkpoint_bitwise_each_reading_exactly_its_share(saved):
    ranks = saved["ranks"]
    assert [r.get("error") for r in ranks] == [None] * 3
    assert [r["digests"] for r in ranks] == [saved["ref"]["dcp"]] * 3  # step-10: the newest step-N folder
    assert [r["bytes_read"] for r in ranks] == [r["share"] for r in ranks]
    # Besides: each chunk's archive records, read once (about 800 bytes a chunk; a rank touches at most both ranks').
    assert [r["structure"] <= 2 * 1024 * r["origin"]["tensors"] for r in ranks] == [True] * 3
    assert (ranks[0]["origin"]["step"], ranks[0]["origin"]["prefix"]) == (10, "")


@pytest.mark.multiprocess
def test_one_rank_starts_from_two_ranks_dcp_checkpoint_bitwise_reading_each_byte_once(saved):
    torch.manual_seed(0)
    model = GPT(256, dropout=0.0, **SHAPE)
    result = load_dcp_model(model, saved["dir"] / "dcp")
    assert digests(model.state_dict()) == saved["ref"]["dcp"]
    assert result.bytes_read == sum(t.nbytes for t in model.state_dict().values())


@pytest.mark.multiprocess
def test_an_export_of_a_two_rank_fsdp2_checkpoint_loads_with_dcp_load_bitwise_on_one_rank_and_three(saved):
    meta = dcp.FileSystemReader(str(saved["dir"] / "export")).read_metadata()
    sd = {k: torch.full(tuple(m.size), 7, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(sd, checkpoint_id=str(saved["dir"] / "export"), no_dist=True)
    assert digests(sd) == saved["ref"]["ftsup"]
    assert [r["export"] for r in saved["ranks"]] == [saved["ref"]["ftsup"]] * 3


@pytest.mark.multiprocess
def test_an_export_with_a_prefix_is_the_model_under_its_own_names(saved, tmp_path):
    assert (
        main(["ckpt", "export-dcp", str(saved["dir"] / "ftsup"), str(tmp_path / "m"), "--prefix", "train.model."]) == 0
    )
    sd = GPT(256, dropout=0.0, **SHAPE).state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "m"), no_dist=True)
    want = {k.removeprefix("train.model."): v for k, v in saved["ref"]["ftsup"].items() if k.startswith("train.model.")}
    assert digests(sd) == want


def first_loss(tmp_path: Path, name: str, nproc: int, init: Path) -> float:
    # DDP: each rank reads 1/3 of every tensor's rows and the ranks all-gather them (FSDP2's boxes: the load worker).
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()] + ["--parallel=ddp"]
    argv = ["-m", "ftsup.trainer.examples.gpt", "--steps", "1", "--ckpt-every", "1", "--global-batch", "6"]
    argv += ["--micro-batch", "2", "--corpus-bytes", "65536", "--ckpt-dir", str(tmp_path / name)]
    argv += ["--loss-log", str(tmp_path / f"{name}.jsonl"), "--init-from-dcp", str(init), *flags]
    if nproc > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", *argv]
    r = run([sys.executable, *argv], timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    return json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[0])["loss"]


@pytest.mark.multiprocess
def test_the_reference_trainer_starts_from_a_dcp_checkpoint_with_the_same_first_loss_on_one_rank_and_three(
    saved, tmp_path
):
    one = first_loss(tmp_path, "one", 1, saved["dir"] / "dcp")
    three = first_loss(tmp_path, "three", 3, saved["dir"] / "dcp")
    assert abs(one - three) <= 1e-5 * abs(one), (one, three)
    meta = layout.read_manifest(tmp_path / "three" / layout.step_dirname(1)).metadata
    assert (meta["init_from_dcp"]["dir"], meta["init_from_dcp"]["step"]) == (
        str((saved["dir"] / "dcp" / "step-10").resolve()),
        10,
    )


PEAK = """
import resource, sys
from ftsup.supervisor.cli.commands import main
import ftsup.trainer.dcp.export
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = main(["ckpt", "export-dcp", *sys.argv[1:]])
print("rss_kib", base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def test_an_export_holds_at_most_the_largest_tensor_plus_256_mib(tmp_path):
    from ftsup import TrainingState
    from ftsup.trainer.checkpoint import CheckpointEngine

    model = torch.nn.ParameterList([torch.nn.Parameter(torch.full((12 << 20,), float(i))) for i in range(8)])
    state = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1))  # 8 tensors of 48 MiB: 384 MiB
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        state.save(engine, kind="final", block=True)
    del model, state
    r = run([sys.executable, "-c", PEAK, str(tmp_path / "ckpt"), str(tmp_path / "x")], timeout=240)
    assert r.returncode == 0, r.output[-3000:]
    base, peak = (int(n) * 1024 for n in r.output.rsplit("rss_kib ", 1)[1].split()[:2])
    assert (tmp_path / "x" / "__0_0.distcp").stat().st_size > 8 * (48 << 20)
    assert peak - base <= (48 << 20) + (256 << 20), (peak - base) / 2**20


def gpt() -> tuple[GPT, dict[str, str]]:
    torch.manual_seed(0)
    model = GPT(256, dropout=0.0, **SHAPE)
    return model, digests(model.state_dict())


def test_a_tensor_the_checkpoint_lacks_names_it_and_loads_nothing(tmp_path):
    sd = GPT(256, dropout=0.0, **SHAPE).state_dict()
    del sd["head.weight"]
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    model, before = gpt()
    with pytest.raises(ModelFileError, match=r"\.metadata: tensor 'head\.weight': the model has 'head\.weight', and"):
        load_dcp_model(model, tmp_path / "d", prefix="")
    assert digests(model.state_dict()) == before


def test_another_shape_names_the_tensor_and_loads_nothing(tmp_path):
    sd = GPT(256, dropout=0.0, **SHAPE).state_dict()
    dcp.save({**sd, "ln.bias": torch.zeros(7)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    model, before = gpt()
    with pytest.raises(ModelFileError, match=r"tensor 'ln\.bias' has shape \[7\]; the model's 'ln\.bias' is \[32\]"):
        load_dcp_model(model, tmp_path / "d")
    assert digests(model.state_dict()) == before


def test_a_missing_data_file_names_it_and_loads_nothing(tmp_path):
    dcp.save({"model": GPT(256, dropout=0.0, **SHAPE).state_dict()}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    (tmp_path / "d" / "__0_0.distcp").unlink()
    model, before = gpt()
    with pytest.raises(ModelFileError, match=r"d/__0_0\.distcp \(named by .*\.metadata\): missing"):
        load_dcp_model(model, tmp_path / "d")
    assert digests(model.state_dict()) == before


def test_a_session_starts_from_one_model_not_two():
    from ftsup import Session

    model, _ = gpt()
    with pytest.raises(ValueError, match="init_from_hf and init_from_dcp"):
        Session(model, torch.optim.SGD(model.parameters(), lr=0.1), init_from_hf="a", init_from_dcp="b")


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_a_chunk_whose_pickle_imports_anything_else_names_the_file_and_the_tensor_and_runs_nothing(
    tmp_path, monkeypatch
):
    dcp.save({"model": GPT(256, dropout=0.0, **SHAPE).state_dict()}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps(_Evil()))
    data = tmp_path / "d" / "__0_0.distcp"
    at = data.stat().st_size
    with open(data, "ab") as f:
        f.write(archive.getvalue())
    with open(tmp_path / "d" / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the test's own file
    for index, info in meta.storage_data.items():
        if index.fqn == "model.ln.bias":
            info.offset, info.length = at, len(archive.getvalue())
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(meta))
    monkeypatch.chdir(tmp_path)
    model, before = gpt()
    with pytest.raises(ModelFileError, match=r"d/__0_0\.distcp \(tensor 'model\.ln\.bias' .*names posix\.system"):
        load_dcp_model(model, tmp_path / "d")
    assert (digests(model.state_dict()), (tmp_path / "pwned").exists()) == (before, False)
