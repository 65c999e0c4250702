"""The Session on a GPU: a run saved and resumed through it continues bitwise as the uninterrupted run did, CUDA
RNG included; and its step guard, heartbeat figures and saves add no device-to-host synchronisation to a loop's
steps (torch's synchronisation debug mode counts every one)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ftsup import Session
from ftsup.trainer.examples.corpus import TokenWindows, generate
from ftsup.trainer.examples.gpt import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda", 0)
STEPS = 6


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    # cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it starts (tests/gpu/run.sh sets it for the whole run).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def session(ckpt: Path, save_every: int | None = 3) -> Session:
    torch.manual_seed(0)
    model = GPT(256, 32, 2, 4, 64, 0.1).to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dataset = TokenWindows(generate(1 << 16), 32)
    return Session(
        model,
        optimizer,
        None,
        dataset,
        global_batch=8,
        micro_batch=2,
        ckpt_dir=ckpt,
        save_every=save_every,
        pin_memory=True,
    )


def train(s: Session, total: int) -> dict[int, str]:
    losses = {}
    for step in s.steps(total):
        total_loss = torch.zeros((), dtype=torch.float64, device=CUDA)
        for _, tokens in s.micro_batches():
            tokens = tokens.to(CUDA, non_blocking=True)
            loss = s.model(tokens[:, :-1], tokens[:, 1:])
            (loss / s.accumulation_steps).backward()
            total_loss += loss.detach().double()
        losses[step] = s.clip_and_step(1.0, total_loss / s.accumulation_steps).mean_loss.hex()
    return losses


def snapshot(s: Session) -> dict[str, bytes]:
    sd = s.state.state_dict()
    out = {}
    for part in ("model", "optim"):
        stack = [(part, sd[part])]
        while stack:
            key, value = stack.pop()
            if isinstance(value, dict):
                stack.extend((f"{key}.{k}", v) for k, v in value.items())
            elif isinstance(value, torch.Tensor):
                out[key] = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return out


def test_a_run_resumed_through_the_session_continues_bitwise_with_its_cuda_rng(tmp_path: Path) -> None:
    whole = session(tmp_path / "whole")
    whole_losses = train(whole, STEPS)
    cut = session(tmp_path / "cut")
    train(cut, 3)  # ends with the final save of step 3
    saved_rng = torch.cuda.get_rng_state(CUDA)
    resumed = session(tmp_path / "cut")  # a fresh model, optimizer and generator: the checkpoint's replace them
    rng_restored = torch.equal(torch.cuda.get_rng_state(CUDA), saved_rng)
    resumed_losses = train(resumed, STEPS)
    assert (resumed.loaded is not None and resumed.loaded.step, rng_restored) == (3, True)
    assert resumed_losses == {k: v for k, v in whole_losses.items() if k > 3}
    assert snapshot(resumed) == snapshot(whole)


def plain_loop_syncs(steps: int) -> list[int]:
    """What a loop without ftsup waits for per step: its `.item()` of the loss."""
    torch.manual_seed(0)
    model = GPT(256, 32, 2, 4, 64, 0.1).to(CUDA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, 33), device=CUDA)
    counts = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return counts


def test_the_guard_heartbeats_and_saves_add_no_synchronisation_to_a_step(tmp_path: Path) -> None:
    s = session(tmp_path, save_every=2)
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in s.steps(8):  # the work between two steps (heartbeat, save) counts to the next one
                marks.append(len(caught))
                total = torch.zeros((), dtype=torch.float64, device=CUDA)
                for _, tokens in s.micro_batches():
                    tokens = tokens.to(CUDA, non_blocking=True)
                    loss = s.model(tokens[:, :-1], tokens[:, 1:])
                    (loss / s.accumulation_steps).backward()
                    total += loss.detach().double()
                s.report(tokens_seen=total)  # a figure still on the device
                s.clip_and_step(1.0, total / s.accumulation_steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    ends = [*marks[1:], len(caught)]
    waits = [sum("synchroniz" in str(w.message) for w in caught[a:b]) for a, b in zip(marks, ends, strict=True)]
    plain = plain_loop_syncs(3)
    assert waits[1:] == [plain[-1]] * 7  # the first step also pays for lazy initialisation
