"""Export to Hugging Face sharded safetensors: whole tensors from any world size, readable by
the safetensors library, never from a corrupt checkpoint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ftsup.trainer.checkpoint import CheckpointCorruptError, CheckpointEngine, CheckpointError
from ftsup.trainer.checkpoint.stateful import ModelOptimState
from ftsup.trainer.hf.export import INDEX_NAME, export_hf
from tests.helpers import flip_byte
from tests.procs import torchrun


def load_index(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export: its index's files, or its one model.safetensors."""
    if not (out / INDEX_NAME).exists():
        return load_file(out / "model.safetensors")
    index = json.loads((out / INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / f))
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


@pytest.mark.multiprocess
def test_fsdp_checkpoint_of_2_ranks_exports_whole_tensors(tmp_path):
    save = ["save", "--dir", str(tmp_path / "ckpt"), "--parallel", "fsdp", "--steps", "2"]
    r = torchrun("ckpt_worker.py", [*save, "--out", str(tmp_path / "save.json")], nproc=2)
    assert r.returncode == 0, r.output[-3000:]
    digests = json.loads((tmp_path / "save.json").read_text())["digests_2"]
    index = export_hf(tmp_path / "ckpt", 2, tmp_path / "hf", max_shard_bytes=40_000)
    tensors = load_index(tmp_path / "hf")
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    got = {
        f"model.{k}": hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, t in tensors.items()
    }
    assert got == {k: v for k, v in digests.items() if k.startswith("model.")}


def test_export_refuses_a_corrupt_checkpoint_and_leaves_no_output(tmp_path):
    model = torch.nn.Linear(64, 64)
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        res = eng.save(1, {"app": ModelOptimState(model)}, block=True)
    flip_byte(Path(res.path) / "shard-00000.safetensors", 5000)
    with pytest.raises(CheckpointCorruptError, match="shard-00000.safetensors"):
        export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and list(tmp_path.glob(".hf*")) == []


def test_export_refuses_a_non_empty_output_directory(tmp_path):
    model = torch.nn.Linear(4, 4)
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        eng.save(1, {"app": ModelOptimState(model)}, block=True)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"


def test_ftsup_ckpt_export_hf_writes_the_index_and_says_what_it_did(tmp_path, capsys):
    from ftsup.supervisor.cli.commands import main

    model = torch.nn.Linear(8, 8)
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        eng.save(4, {"app": ModelOptimState(model)}, block=True)
    assert main(["ckpt", "export-hf", str(tmp_path / "ckpt"), "--step", "4", str(tmp_path / "hf")]) == 0
    assert "exported step 4: 2 tensors" in capsys.readouterr().out
    tensors = load_index(tmp_path / "hf")
    assert torch.equal(tensors["weight"], model.weight.detach()) and torch.equal(tensors["bias"], model.bias.detach())


def test_export_of_a_training_state_with_a_transformers_config_loads_with_from_pretrained_and_gives_its_logits(
    tmp_path,
):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from ftsup import GlobalBatchSchedule, TrainingState
    from ftsup.supervisor.cli.commands import main

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(16).unsqueeze(0), labels=torch.arange(16).unsqueeze(0)).loss.backward()
    optimizer.step()  # weights that are not the initial ones
    state = TrainingState(model, optimizer, schedule=GlobalBatchSchedule(64, 4, 4, 1, 0, 0), config=config.to_dict())
    state.step, state.samples = 1, 4
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        state.save(eng, kind="final", block=True)
    assert main(["ckpt", "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.arange(16).unsqueeze(0) % 64
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model.eval()(x).logits)


def test_export_without_a_config_in_the_checkpoint_takes_config_or_says_it_wrote_none(tmp_path, capsys):
    from ftsup.supervisor.cli.commands import main

    model = torch.nn.Linear(4, 4)
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        eng.save(1, {"app": ModelOptimState(model)}, block=True)
    assert main(["ckpt", "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "bare")]) == 0
    assert "no config.json written" in capsys.readouterr().err and not (tmp_path / "bare" / "config.json").exists()
    (tmp_path / "cfg.json").write_text('{"model_type": "gpt2", "n_embd": 4}')
    args = ["ckpt", "export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config", str(tmp_path / "cfg.json")]
    assert main(args) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "gpt2", "n_embd": 4}
