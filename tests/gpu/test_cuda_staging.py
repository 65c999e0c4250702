"""A save from CUDA memory (trainer/checkpoint/DESIGN.md, "Staging on a GPU"): the caller's thread only launches
copies into page-locked buffers on a side stream, makes no synchronising call, and the training stream goes on;
the checkpoint still holds the state of the call, because the next optimizer step waits for the copies on the
device."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ftsup.trainer.checkpoint import CheckpointEngine
from ftsup.trainer.checkpoint.devcopy import HostBuffers, SideStreams
from ftsup.trainer.checkpoint.stateful import ModelOptimState

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda", 0)
WIDE = 8192  # a 256 MiB weight: its copy to the host takes milliseconds, its SGD step far less


def engine(path: Path) -> CheckpointEngine:
    return CheckpointEngine(path, process_group=None, durable_tier=None)


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def model_and_optimizer() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDE, WIDE, bias=False).to(CUDA)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step(model, optimizer)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(4, WIDE, device=CUDA)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_host_buffers_are_page_locked_of_the_size_asked_until_closed() -> None:
    host = HostBuffers()
    buf = host.allocate(3 * 2**20 + 5)
    locked = (buf.numel(), buf.is_pinned(), host.holds(buf))
    host.close()
    assert (locked, buf.is_pinned()) == ((3 * 2**20 + 5, True, True), False)


def test_copies_are_launched_and_land_later_with_the_values_of_the_launch() -> None:
    host = HostBuffers()
    src = torch.randn(WIDE, WIDE, device=CUDA)
    dst = host.allocate(src.numel() * 4).view(torch.float32).view(WIDE, WIDE)
    expected = bits(src)
    copies = SideStreams().launch([(dst, src)])
    in_flight = not copies.done()
    copies.fence()
    src.zero_()  # queued behind the copy on the current stream
    copies.landed()
    try:
        assert (in_flight, bits(dst) == expected) == (True, True)
    finally:
        host.close()


def test_a_save_from_cuda_memory_makes_no_synchronising_call(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    state = {"app": ModelOptimState(model, optimizer)}
    with engine(tmp_path) as e:
        e.save(1, state).wait()  # the first save plans and makes its buffers
        torch.cuda.set_sync_debug_mode("error")  # a synchronising call now raises
        try:
            handle = e.save(2, state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert handle.wait().step == 2


def test_the_checkpoint_holds_the_state_of_the_call_while_optimizer_steps_follow_at_once(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    expected = bits(model.weight)
    with engine(tmp_path) as e:
        handle = e.save(1, {"app": ModelOptimState(model, optimizer)})
        for _ in range(3):  # each writes the weight in place: the first waits for the copy, on the device
            step(model, optimizer)
        handle.wait()
        changed = bits(model.weight) != expected
        fresh = torch.nn.Linear(WIDE, WIDE, bias=False).to(CUDA)
        e.load({"app": ModelOptimState(fresh, torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9))})
    assert (changed, bits(fresh.weight) == expected) == (True, True)


def test_fence_orders_an_in_place_write_that_is_no_optimizer_step_after_the_copy(tmp_path: Path) -> None:
    weight = torch.randn(WIDE, WIDE, device=CUDA)
    expected = bits(weight)
    with engine(tmp_path) as e:
        handle = e.save(1, {"w": weight})
        e.fence()
        weight.mul_(0)
        handle.wait()
        loaded = {"w": torch.empty_like(weight)}
        e.load(loaded)
    assert bits(loaded["w"]) == expected


def test_training_steps_run_on_the_gpu_while_the_save_is_held_before_its_commit(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer()
    held, release = threading.Event(), threading.Event()

    def hold(point: str, at: int) -> None:
        if point == "shard_written":  # the writer thread: the save is not committed until released
            held.set()
            release.wait(60)

    with CheckpointEngine(tmp_path, process_group=None, durable_tier=None, hook=hold) as e:
        handle = e.save(1, {"app": ModelOptimState(model, optimizer)})
        assert held.wait(60)
        for _ in range(5):
            step(model, optimizer)
        torch.cuda.synchronize()  # the steps have run on the device while the commit is held
        done_during = handle.done()
        release.set()
        assert (done_during, handle.wait().step) == (False, 1)
