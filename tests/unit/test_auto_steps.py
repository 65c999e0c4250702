"""The auto-instrumentation's progress (`ftsup.trainer.auto.steps.Progress`) against a real heartbeat receiver in
this process: the first optimizer's steps are beats, the trained model's `.eval()` is phase eval, a blocking save is
phase save, and it stands down for good once the script asks for ftsup's client itself."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ftsup.protocol import Phase, RuntimeEnv
from ftsup.supervisor.run.heartbeat import HeartbeatReceiver
from ftsup.trainer.auto.steps import Progress, held_steps
from ftsup.trainer.runtime import RuntimeClient


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[HeartbeatReceiver]:
    with HeartbeatReceiver(tmp_path / "run") as r:
        yield r


class Taken:
    """Whether the script has asked for ftsup's client: what `runtime_taken` says, set by the test."""

    def __init__(self) -> None:
        self.value = False

    def __call__(self) -> bool:
        return self.value


def progress(receiver: HeartbeatReceiver, taken: Taken | None = None) -> Progress:
    # An interval no test waits out: the keep-alive thread of phase eval sends nothing while a test runs.
    env = RuntimeEnv(heartbeat_socket=str(receiver.path), heartbeat_interval_s=60.0, attempt=1)
    ticks = itertools.count(0.0, 0.25)  # each reading of the clock a quarter second later
    return Progress(lambda: RuntimeClient(env), taken=taken or Taken(), mono=lambda: next(ticks))


def beats(receiver: HeartbeatReceiver) -> list[tuple[int, str]]:
    return [(b.step, str(b.phase)) for b in receiver.drain()]


Optimizer = torch.optim.Optimizer


def model_and_optimizer(kind: Callable[..., Optimizer] = torch.optim.SGD) -> tuple[torch.nn.Sequential, Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    return model, kind(model.parameters(), lr=0.1)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()


def test_each_step_of_the_first_optimizer_is_a_beat_with_its_step_time(receiver):
    p = progress(receiver)
    model, opt = model_and_optimizer()
    other = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    for _ in range(3):
        p.stepped(opt)
        p.stepped(other)  # a second optimizer of the same loop (a GAN's) counts no step of its own
    got = receiver.drain()
    assert [(b.step, str(b.phase)) for b in got] == [(1, "train"), (2, "train"), (3, "train")]
    assert [dict(b.figures).get("step_s") for b in got] == [None, 0.25, 0.25]


def test_an_optimizer_resumed_from_a_scripts_own_checkpoint_goes_on_from_its_own_step_count(receiver):
    model, opt = model_and_optimizer(torch.optim.AdamW)
    for _ in range(5):
        step(model, opt)
    resumed_model, resumed = model_and_optimizer(torch.optim.AdamW)
    resumed.load_state_dict(opt.state_dict())
    step(resumed_model, resumed)
    p = progress(receiver)
    p.stepped(resumed)
    assert (held_steps(resumed), beats(receiver)) == (6, [(6, "train")])


def test_an_optimizer_that_keeps_no_step_count_counts_from_one(receiver):
    model, opt = model_and_optimizer(torch.optim.SGD)
    step(model, opt)
    assert held_steps(opt) == 1


def test_the_trained_models_eval_is_phase_eval_until_its_train(receiver):
    p = progress(receiver)
    model, opt = model_and_optimizer()
    p.stepped(opt)
    p.switched(model, False)
    in_eval = beats(receiver)
    p.switched(model, True)
    assert (in_eval, beats(receiver)) == ([(1, "train"), (1, "eval")], [(1, "train")])


def test_a_part_of_the_model_switched_to_eval_is_no_phase(receiver):
    p = progress(receiver)
    model, opt = model_and_optimizer()
    p.stepped(opt)
    p.switched(model[0], False)  # a fine-tuning script freezing one layer's statistics
    assert beats(receiver) == [(1, "train")]


def test_nothing_is_a_phase_before_the_first_step(receiver):
    p = progress(receiver)
    model, _ = model_and_optimizer()
    p.switched(model, False)
    assert (p.enter(Phase.SAVE), beats(receiver)) == (None, [])


def test_a_blocking_save_after_a_step_is_phase_save(receiver):
    p = progress(receiver)
    model, opt = model_and_optimizer()
    p.stepped(opt)
    saving = p.enter(Phase.SAVE)
    assert saving is not None
    saving.close()
    assert beats(receiver) == [(1, "train"), (1, "save"), (1, "train")]


def test_the_end_of_training_is_phase_done(receiver):
    p = progress(receiver)
    model, opt = model_and_optimizer()
    p.stepped(opt)
    p.done()
    assert beats(receiver) == [(1, "train"), (1, "done")]


def test_once_the_script_asks_for_ftsups_client_no_beat_of_its_own_goes(receiver):
    taken = Taken()
    p = progress(receiver, taken)
    model, opt = model_and_optimizer()
    p.stepped(opt)
    p.switched(model, False)
    taken.value = True
    p.stepped(opt)
    p.switched(model, True)
    p.done()
    assert (beats(receiver), p.active) == ([(1, "train"), (1, "eval")], False)


def test_a_script_that_asks_for_ftsups_client_before_its_first_step_sends_no_auto_beat(receiver):
    taken = Taken()
    taken.value = True
    p = progress(receiver, taken)
    model, opt = model_and_optimizer()
    p.stepped(opt)
    assert (beats(receiver), p.active) == ([], False)


def test_a_forked_child_such_as_a_data_loader_worker_sends_nothing(receiver):
    p = progress(receiver)
    model, opt = model_and_optimizer()
    p.stepped(opt)
    receiver.drain()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the rank's progress is its own to report
        os._exit(0 if (p.enter(Phase.SAVE), p.stepped(opt)) == (None, False) else 1)
    _, status = os.waitpid(pid, 0)
    assert (os.waitstatus_to_exitcode(status), beats(receiver)) == (0, [])
