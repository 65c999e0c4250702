"""A fresh run's weights from a Hugging Face Hub-layout model, read straight into a model's CUDA parameters
(`ftsup.trainer.hf.load`): every tensor bitwise the file's, and every byte of them read once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ftsup.trainer.examples.gpt import GPT
from ftsup.trainer.hf.load import load_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda", 0)


def raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_hub_weights_load_bitwise_into_cuda_parameters(tmp_path: Path) -> None:
    torch.manual_seed(1)
    sd = GPT(256, 32, 2, 2, 64, 0.0).state_dict()
    save_torch_state_dict(sd, tmp_path / "hub", max_shard_size="40KB")  # several shards and an index
    torch.manual_seed(2)
    model = GPT(256, 32, 2, 2, 64, 0.0).to(CUDA)
    result = load_hf_model(model, tmp_path / "hub")
    on_cuda = {p.device.type for p in model.parameters()}
    loaded = {k: raw(v) for k, v in model.state_dict().items()}
    assert (on_cuda, loaded) == ({"cuda"}, {k: raw(v) for k, v in sd.items()})
    assert result.bytes_read == sum(v.numel() * v.element_size() for v in sd.values())
