"""A load into a fresh optimizer: its state made over meta-device twins of the parameters instead of torch's step over
zero gradients, the same structure as torch's, filled by the load, and fresh again where the load fails or does not
fill it (trainer/checkpoint/DESIGN.md, Loading into a fresh optimizer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointError, NoCheckpointError, freshoptim
from ftsup.trainer.checkpoint.stateful import ModelOptimState

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01, initial_accumulator_value=0.5),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True),
}


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    m[2].bias.requires_grad_(False)  # a frozen parameter: no gradient, no state, as torch's own way
    return m


def trained(make: Callable[[Any], torch.optim.Optimizer]) -> ModelOptimState:
    m = model(0)
    optim = make(m.parameters())
    for i in range(3):
        torch.manual_seed(100 + i)
        m(torch.randn(4, 8)).square().sum().backward()
        optim.step()
        optim.zero_grad()
    return ModelOptimState(m, optim)


def opt(state: ModelOptimState) -> torch.optim.Optimizer:
    assert state.optimizer is not None
    return state.optimizer


def state_of(optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The state of each trained parameter, by its place (torch's `get_state_dict` leaves out a frozen one's)."""
    params = [p for g in optim.param_groups for p in g["params"]]
    return {f"{i}.{k}": v.clone() for i, p in enumerate(params) if p.requires_grad for k, v in optim.state[p].items()}


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    eng = CheckpointEngine(tmp_path / "ckpt")
    yield eng
    try:
        eng.close()
    except CheckpointError:
        pass


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_state_made_has_torchs_structure(name: str) -> None:
    ours = ModelOptimState(m := model(1), OPTIMIZERS[name](m.parameters()))
    theirs_model = model(1)
    theirs = OPTIMIZERS[name](theirs_model.parameters())
    made_by_constructor = bool(opt(ours).state)  # Adagrad's sums: not fresh, left as they are
    assert freshoptim.prepare({"app": ours}) == ([] if made_by_constructor else [opt(ours)])
    _init_optim_state(theirs)
    a, b = list(opt(ours).state.values()), list(theirs.state.values())
    shapes = [{k: (v.shape, v.dtype, v.device) if torch.is_tensor(v) else v for k, v in s.items()} for s in a]
    assert shapes == [{k: (v.shape, v.dtype, v.device) if torch.is_tensor(v) else v for k, v in s.items()} for s in b]
    assert all(p.grad is None for p in m.parameters())  # the real parameters untouched, no gradient left
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), model(1).parameters(), strict=True))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_load_into_a_fresh_optimizer_is_the_saved_state_bitwise(engine: CheckpointEngine, name: str) -> None:
    saved = trained(OPTIMIZERS[name])
    engine.save(3, {"app": saved}, block=True)
    fresh = ModelOptimState(m := model(7), OPTIMIZERS[name](m.parameters()))
    assert engine.load({"app": fresh}).step == 3
    want, got = state_of(opt(saved)), state_of(opt(fresh))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), saved.model.parameters(), strict=True))


def test_a_failed_load_leaves_the_optimizer_fresh(engine: CheckpointEngine) -> None:
    fresh = ModelOptimState(m := model(7), torch.optim.AdamW(m.parameters()))
    with pytest.raises(NoCheckpointError):
        engine.load({"app": fresh})
    assert not opt(fresh).state  # its first step stays its first (Adam's bias correction counts it)


class ModelOnly:
    """A user's Stateful that keeps an optimizer but saves only the model."""

    def __init__(self, m: torch.nn.Module) -> None:
        self.model, self.optimizer = m, torch.optim.AdamW(m.parameters())

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])


def test_an_optimizer_the_state_does_not_save_is_left_fresh(engine: CheckpointEngine) -> None:
    engine.save(2, {"app": ModelOnly(model(0))}, block=True)
    target = ModelOnly(model(7))
    assert engine.load({"app": target}).step == 2
    assert not target.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(target.model.parameters(), model(0).parameters(), strict=True))


def test_an_optimizer_whose_step_cannot_run_on_meta_tensors_is_left_to_torch(engine: CheckpointEngine) -> None:
    saved = trained(lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True))
    engine.save(3, {"app": saved}, block=True)
    fresh = ModelOptimState(m := model(7), torch.optim.Adam(m.parameters(), lr=0.01, fused=True))
    assert freshoptim.prepare({"app": fresh}) == [] and not opt(fresh).state
    assert engine.load({"app": fresh}).step == 3
    want, got = state_of(opt(saved)), state_of(opt(fresh))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
