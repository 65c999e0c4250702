"""On a GPU, the reference trainer's step through the step guard waits for the device once: the
copy of loss and gradient norm to the host, which its loss log then uses (torch's synchronisation
debug mode counts every wait). Skipped where there is no CUDA device."""

from __future__ import annotations

import warnings

import pytest
import torch

from ftsup import Session
from ftsup.trainer.examples.corpus import TokenWindows, generate
from ftsup.trainer.examples.gpt import GPT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_guarded_step_on_a_gpu_synchronises_with_the_host_once(tmp_path):
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = GPT(256, 32, 2, 4, 64, 0.1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dataset = TokenWindows(generate(1 << 16), 32)
    session = Session(
        model,
        optimizer,
        None,
        dataset,
        global_batch=8,
        micro_batch=2,
        ckpt_dir=tmp_path,
        save_every=None,
        pin_memory=True,
    )
    waits = []
    for _ in session.steps(6):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            total = torch.zeros((), dtype=torch.float64, device=device)
            for _, tokens in session.micro_batches():
                tokens = tokens.to(device, non_blocking=True)
                loss = model(tokens[:, :-1], tokens[:, 1:])
                (loss / session.accumulation_steps).backward()
                total += loss.detach().double()
            check = session.clip_and_step(1.0, total / session.accumulation_steps)
            torch.cuda.set_sync_debug_mode("default")
        waits.append(sum("synchronizing" in str(w.message) for w in caught))
        assert check.mean_loss == check.mean_loss  # a number on the host: no .item() needed
    assert waits[1:] == [1] * 5  # the first step also pays for lazy initialisation
