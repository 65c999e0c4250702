"""Starting from a Hugging Face model directory (`ftsup.trainer.hf.load.load_hf_model`, the reference trainer's
`--init-from-hf`): every tensor bitwise the file's on one rank and on two (DDP, FSDP2), each rank reading exactly
its share; the reference trainer's first loss the same on one rank and two; a transformers model saved by
`save_pretrained` in shards trains its first step from its own weights on one rank and on two (FSDP2), each rank
reading its share as the kernel counts it; bad input loads nothing."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ftsup.store import layout
from ftsup.store.errors import ModelFileError
from ftsup.trainer.examples.gpt import GPT
from ftsup.trainer.hf.load import load_hf_model
from tests.hubfiles import overlap, past_end, rewrite_header, with_two_tensors
from tests.procs import python, run, torchrun

SHAPE = {"seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}  # tests/bin/hf_init_worker.py's


def hub_model(path: Path, seed: int = 1, max_shard_size: str = "20KB") -> dict[str, torch.Tensor]:
    """The reference GPT of `seed`, written as huggingface_hub writes a sharded model; its state dict."""
    torch.manual_seed(seed)
    sd = GPT(256, dropout=0.0, **SHAPE).state_dict()
    path.mkdir()
    save_torch_state_dict(sd, path, max_shard_size=max_shard_size)
    return sd


def digests(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in sd.items()
    }


def shares(sd: dict[str, torch.Tensor], world: int) -> list[int]:
    """The bytes each rank reads: rows [r*c, (r+1)*c) of each tensor, c = ceil(rows / world); a tensor of
    fewer rows than ranks all on rank 0."""
    out = [0] * world
    for t in sd.values():
        n = t.shape[0] if t.dim() else 0
        if n < world:
            out[0] += t.nbytes
            continue
        c = -(-n // world)
        for r in range(world):
            out[r] += max(0, min((r + 1) * c, n) - r * c) * (t.nbytes // n)
    return out


def test_one_process_loads_every_tensor_bitwise_reading_each_byte_once(tmp_path):
    sd = hub_model(tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    torch.manual_seed(0)
    model = GPT(256, dropout=0.0, **SHAPE)
    result = load_hf_model(model, tmp_path / "hf")
    assert digests(model.state_dict()) == digests(sd)
    assert (result.bytes_read, result.origin["tensors"], result.origin["dir"]) == (
        sum(t.nbytes for t in sd.values()),
        len(sd),
        str((tmp_path / "hf").resolve()),
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_load_every_tensor_bitwise_each_reading_exactly_its_share(tmp_path, parallel):
    sd = hub_model(tmp_path / "hf")
    r = torchrun(
        "hf_init_worker.py",
        ["--hf", str(tmp_path / "hf"), "--parallel", parallel, "--out", str(tmp_path / "rank")],
        nproc=2,
    )
    assert r.returncode == 0, r.output[-3000:]
    outs = [json.loads((tmp_path / f"rank.{i}.json").read_text()) for i in (0, 1)]
    assert [o.get("error") for o in outs] == [None, None]
    assert [o["digests"] for o in outs] == [digests(sd)] * 2
    assert [o["bytes_read"] for o in outs] == shares(sd, 2)


def model_and_before() -> tuple[GPT, dict[str, str]]:
    torch.manual_seed(0)
    model = GPT(256, dropout=0.0, **SHAPE)
    return model, digests(model.state_dict())


def test_a_model_tensor_the_files_lack_names_it_and_loads_nothing(tmp_path):
    sd = hub_model(tmp_path / "src")
    del sd["head.weight"]
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(sd, tmp_path / "hf", max_shard_size="20KB")
    model, before = model_and_before()
    with pytest.raises(ModelFileError, match="the model has tensor 'head.weight'.*which no file of the model holds"):
        load_hf_model(model, tmp_path / "hf")
    assert digests(model.state_dict()) == before


def test_a_file_tensor_the_model_lacks_names_the_file_and_the_tensor_and_loads_nothing(tmp_path):
    sd = hub_model(tmp_path / "src")
    (tmp_path / "hf").mkdir()
    save_torch_state_dict({**sd, "extra.weight": torch.zeros(3)}, tmp_path / "hf", max_shard_size="20KB")
    model, before = model_and_before()
    with pytest.raises(
        ModelFileError,
        match=r"model-\d{5}-of-\d{5}\.safetensors: holds tensor 'extra\.weight', "
        "which the model does not have",
    ):
        load_hf_model(model, tmp_path / "hf")
    assert digests(model.state_dict()) == before


def test_another_shape_names_the_file_and_the_tensor_and_loads_nothing(tmp_path):
    sd = hub_model(tmp_path / "src")
    (tmp_path / "hf").mkdir()
    save_torch_state_dict({**sd, "ln.bias": torch.zeros(7)}, tmp_path / "hf")
    model, before = model_and_before()
    with pytest.raises(ModelFileError, match=r"model\.safetensors: tensor 'ln\.bias' has shape \[7\]; the model's"):
        load_hf_model(model, tmp_path / "hf")
    assert digests(model.state_dict()) == before


def test_another_floating_dtype_is_refused_unless_converting(tmp_path):
    sd = hub_model(tmp_path / "src")
    half = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(half, tmp_path / "hf")
    model, before = model_and_before()
    with pytest.raises(ModelFileError, match="is bfloat16; the model's .* is float32 \\(convert=True"):
        load_hf_model(model, tmp_path / "hf")
    assert digests(model.state_dict()) == before
    load_hf_model(model, tmp_path / "hf", convert=True)
    assert digests(model.state_dict()) == digests({k: v.to(torch.float32) for k, v in half.items()})


def test_a_training_state_started_from_a_hub_model_records_its_origin_in_the_checkpoints_that_follow(tmp_path):
    from ftsup import GlobalBatchSchedule, TrainingState
    from ftsup.trainer.checkpoint import CheckpointEngine

    sd = hub_model(tmp_path / "hf")
    model, _ = model_and_before()
    state = TrainingState(model, torch.optim.AdamW(model.parameters()), schedule=GlobalBatchSchedule(64, 4, 4, 1, 0, 0))
    result = state.init_from_hf(tmp_path / "hf")
    state.step, state.samples = 1, 4
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        state.save(eng, kind="final", block=True)
    meta = layout.read_manifest(tmp_path / "ckpt" / layout.step_dirname(1)).metadata
    assert (digests(model.state_dict()), meta["init_from_hf"]) == (digests(sd), result.origin)


def test_names_are_mapped_by_rename(tmp_path):
    sd = hub_model(tmp_path / "src")
    (tmp_path / "hf").mkdir()
    save_torch_state_dict({f"gpt.{k}": v for k, v in sd.items()}, tmp_path / "hf")
    model, _ = model_and_before()
    load_hf_model(model, tmp_path / "hf", rename=lambda key: f"gpt.{key}")
    assert digests(model.state_dict()) == digests(sd)


def test_a_transformers_model_saved_sharded_with_tied_weights_loads_with_the_same_logits(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(1)
    saved = GPT2LMHeadModel(config).eval()
    saved.save_pretrained(tmp_path / "hf", max_shard_size="30KB")  # lm_head.weight is wte's: saved once
    torch.manual_seed(2)
    model = GPT2LMHeadModel(config).eval()
    result = load_hf_model(model, tmp_path / "hf")
    x = torch.arange(16).unsqueeze(0) % 64
    with torch.no_grad():
        assert torch.equal(model(x).logits, saved(x).logits)
    assert (
        len(result.origin["files"]) > 1 and model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    )


GPT2: dict[str, Any] = {
    "vocab_size": 256,
    "n_positions": 32,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A transformers GPT-2 saved by `save_pretrained` in several shards, then one training step started from it
    by tests/bin/hf_gpt2_run.py on one rank and on two (FSDP2): the saved model and each run's per-rank results."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tmp = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(1)
    saved = GPT2LMHeadModel(GPT2Config(**GPT2)).eval()
    saved.save_pretrained(tmp / "hf", max_shard_size="100KB")
    runs = {}
    for name, nproc in (("one", 1), ("two", 2)):
        args = ["--hf", str(tmp / "hf"), "--ckpt-dir", str(tmp / f"ckpt-{name}"), "--out", str(tmp / name)]
        r = (
            python("hf_gpt2_run.py", args, timeout=240)
            if nproc == 1
            else torchrun("hf_gpt2_run.py", args, nproc=2, timeout=240)
        )
        assert r.returncode == 0, r.output[-3000:]
        runs[name] = [json.loads((tmp / f"{name}.{i}.json").read_text()) for i in range(nproc)]
    shards = len(list((tmp / "hf").glob("model-*-of-*.safetensors")))
    index = tmp / "hf" / "model.safetensors.index.json"
    total = json.loads(index.read_text())["metadata"]["total_size"]
    return {"saved": saved, "shards": shards, "tensor_bytes": total, "index_bytes": index.stat().st_size, **runs}


@pytest.mark.multiprocess
def test_a_transformers_model_saved_in_shards_trains_its_first_step_from_its_weights_on_one_rank_and_two_fsdp2(
    gpt2_runs,
):
    from ftsup.trainer.examples.corpus import TokenWindows, generate

    saved, (one,), two = gpt2_runs["saved"], gpt2_runs["one"], gpt2_runs["two"]
    data = TokenWindows(generate(65536), 32)
    with torch.no_grad():  # the saved model's own loss on the micro-batches the step trained on
        losses = [
            saved(input_ids=x, labels=x).loss.double()
            for ids in one["micro_batches"]
            for x in [torch.stack([data[i][1][:-1] for i in ids])]
        ]
    want = float(sum(losses) / len(losses))
    assert gpt2_runs["shards"] > 2
    assert sorted(i for r in two for b in r["micro_batches"] for i in b) == sorted(sum(one["micro_batches"], []))
    assert (abs(one["loss"] - want) <= 1e-5 * want, [abs(r["loss"] - one["loss"]) <= 1e-5 * want for r in two]) == (
        True,
        [True, True],
    ), (want, one["loss"], [r["loss"] for r in two])


@pytest.mark.multiprocess
def test_each_fsdp2_rank_reads_its_share_of_a_sharded_transformers_model_and_one_rank_all_of_it(gpt2_runs):
    (one,), two = gpt2_runs["one"], gpt2_runs["two"]
    total = gpt2_runs["tensor_bytes"]  # the files' tensors: the whole model, its tied weights once

    # Beside its share: the index, the files' headers, each tensor's range widened to whole pages at both ends (read
    # with O_DIRECT) and the few bytes of the ranks' agreement.
    def bound(r: dict) -> int:
        return r["share"] + r["header_bytes"] + gpt2_runs["index_bytes"] + 2 * 4096 * r["tensors"] + 1024

    measured = [r["share"] <= r["rchar"] <= bound(r) for r in (one, *two)]
    assert (one["share"], sum(r["share"] for r in two), [r["bytes_read"] for r in two], one["bytes_read"]) == (
        total,
        total,
        [r["share"] for r in two],
        total,
    )
    assert measured == [True] * 3, [(r["share"], r["rchar"], r["header_bytes"]) for r in (one, *two)]


def first_loss(tmp_path: Path, name: str, nproc: int, init: Path | None, parallel: str = "ddp") -> float:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()] + [f"--parallel={parallel}"]
    argv = ["-m", "ftsup.trainer.examples.gpt", "--steps", "1", "--ckpt-every", "1", "--global-batch", "4"]
    argv += ["--micro-batch", "2", "--corpus-bytes", "65536", "--ckpt-dir", str(tmp_path / name)]
    argv += ["--loss-log", str(tmp_path / f"{name}.jsonl"), *flags]
    argv += ["--init-from-hf", str(init)] if init else []
    if nproc > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", *argv]
    r = run([sys.executable, *argv], timeout=180)
    assert r.returncode == 0, r.output[-3000:]
    return json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[0])["loss"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A hub model, and the reference trainer's first loss on one rank started from it and from its own weights: the
    same for both cases below, which train two ranks from the model."""
    tmp = tmp_path_factory.mktemp("one-rank")
    hub_model(tmp / "hf")
    return {"hf": tmp / "hf", "one": first_loss(tmp, "one", 1, tmp / "hf"), "own": first_loss(tmp, "own", 1, None)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_reference_trainer_starts_from_a_hub_model_with_the_same_first_loss_on_one_rank_and_two(
    one_rank, tmp_path, parallel
):
    one, own, hf = one_rank["one"], one_rank["own"], one_rank["hf"]
    two = first_loss(tmp_path, "two", 2, hf, parallel)
    assert (abs(one - two) <= 1e-4 * abs(one), one != own) == (True, True), (one, two, own)
    meta = layout.read_manifest(tmp_path / "two" / layout.step_dirname(1)).metadata
    assert meta["init_from_hf"]["dir"] == str(hf.resolve())


@pytest.mark.parametrize(
    ("break_it", "says"),
    [
        (
            lambda d: next(d.glob("model-00002-*.safetensors")).unlink(),
            r"names model-00002-of-\d{5}\.safetensors "
            r"\(for tensor '[^']+'\), which is missing",
        ),
        (
            lambda d: next(d.glob("model-00001-*.safetensors")).write_bytes(b"\x08" + bytes(7) + b'{"a": 1}'),
            r"model-00001-of-\d{5}\.safetensors: tensor 'a': not an object of exactly dtype, shape and data_offsets",
        ),
        (
            lambda d: rewrite_header(with_two_tensors(d), overlap),
            r"model-\d{5}-of-\d{5}\.safetensors: tensor '[^']+' overlaps tensor '[^']+'",
        ),
        (
            lambda d: rewrite_header(with_two_tensors(d), past_end),
            r"model-\d{5}-of-\d{5}\.safetensors: tensor '[^']+': its bytes \[\d+, \d+\) run past the end of the file",
        ),
    ],
    ids=["missing-shard", "bad-header", "overlapping-header", "header-past-the-end"],
)
def test_a_hostile_hub_directory_names_the_file_and_loads_nothing(tmp_path, break_it, says):
    hub_model(tmp_path / "hf")
    break_it(tmp_path / "hf")
    model, before = model_and_before()
    with pytest.raises(ModelFileError, match=says):
        load_hf_model(model, tmp_path / "hf")
    assert digests(model.state_dict()) == before


def test_a_dtype_torch_lacks_names_the_file_and_the_tensor(tmp_path):
    from ftsup.store import stheader

    sd = hub_model(tmp_path / "src")
    entries = [(k, "F32", list(v.shape), v.nbytes) for k, v in sd.items() if k != "ln.bias"]
    entries.append(("ln.bias", "F6_E2M3", [32], 24))  # 32 six-bit values: a dtype of safetensors' that torch lacks
    (tmp_path / "hf").mkdir()
    head = stheader.encode(entries, None)
    (tmp_path / "hf" / "model.safetensors").write_bytes(head + bytes(sum(e[3] for e in entries)))
    model, before = model_and_before()
    with pytest.raises(ModelFileError, match=r"model\.safetensors: tensor 'ln\.bias' has dtype F6_E2M3, which torch"):
        load_hf_model(model, tmp_path / "hf")
    assert digests(model.state_dict()) == before


def test_a_file_cut_short_under_a_batched_read_fails_it_naming_the_file(tmp_path, monkeypatch):
    from ftsup.store import hublayout
    from ftsup.trainer.hf import hubread
    from ftsup.trainer.hf.hubread import HubReader

    torch.manual_seed(0)
    sd = {f"t{i}": torch.randn(256, 1024) for i in range(4)}  # 1 MiB each, one file
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(sd, tmp_path / "hf")
    monkeypatch.setattr(hubread, "PIECE_BYTES", 256 << 10)  # several pieces per tensor, over the reading threads
    with HubReader(hublayout.read(tmp_path / "hf")) as reader:
        reader.read_rows("t0", 0, 1)  # the file is open (and its size checked) from here on
        path = tmp_path / "hf" / "model.safetensors"
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - (3 << 20))  # most of the last three tensors' bytes
        outs = [torch.zeros(t.nbytes, dtype=torch.uint8) for t in sd.values()]
        with pytest.raises(ModelFileError, match=r"model\.safetensors: ends inside tensor 't[123]'"):
            reader.read_rows_into([(name, 0, 256, out) for name, out in zip(sd, outs, strict=True)])
