"""The checkpoint engine never commits a state holding a NaN or an infinity (`finite`): the save
fails naming the tensor, nothing is written, the previous checkpoint stays the latest."""

from __future__ import annotations

import math

import pytest
import torch

from ftsup.store import layout
from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointSaveError


class Tensors:
    """A Stateful of named tensors."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(sd)


def poisoned(dtype: torch.dtype, value: float) -> torch.Tensor:
    t = torch.linspace(-1, 1, 1000).to(dtype)
    t[617] = value
    return t


def test_a_save_of_a_state_holding_a_nan_fails_naming_the_tensor(tmp_path):
    with CheckpointEngine(tmp_path) as engine:
        state = Tensors(weight=torch.ones(10), moment=poisoned(torch.float32, math.nan))
        with pytest.raises(CheckpointSaveError, match=r"tensor app\.moment@0 holds a NaN or an infinity"):
            engine.save(1, {"app": state}, block=True)


def test_a_refused_save_leaves_the_previous_checkpoint_the_latest_and_nothing_else(tmp_path):
    with CheckpointEngine(tmp_path) as engine:
        engine.save(1, {"app": Tensors(w=torch.ones(10))}, block=True)
        with pytest.raises(CheckpointSaveError):
            engine.save(2, {"app": Tensors(w=poisoned(torch.float32, math.inf))}, block=True)
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert (layout.latest_consistent(tmp_path).step, names) == (1, ["step-000000001"])


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2, torch.float8_e4m3fn, torch.complex64]
)
def test_a_nan_is_found_in_every_floating_dtype(tmp_path, dtype):
    with CheckpointEngine(tmp_path) as engine, pytest.raises(CheckpointSaveError, match="app.t@0"):
        engine.save(1, {"app": Tensors(t=poisoned(dtype, math.nan))}, block=True)


def test_a_negative_infinity_is_found(tmp_path):
    with CheckpointEngine(tmp_path) as engine, pytest.raises(CheckpointSaveError, match="app.t@0"):
        engine.save(1, {"app": Tensors(t=poisoned(torch.float32, -math.inf))}, block=True)


def test_integer_tensors_and_finite_extremes_are_saved(tmp_path):
    big = torch.tensor([torch.finfo(torch.float32).max, torch.finfo(torch.float32).min, 0.0])
    with CheckpointEngine(tmp_path) as engine:
        result = engine.save(1, {"app": Tensors(big=big, ids=torch.arange(5))}, block=True)
    assert result.step == 1


def test_an_engine_told_not_to_check_commits_a_state_holding_infinities(tmp_path):
    with CheckpointEngine(tmp_path, check_finite=False) as engine:
        engine.save(1, {"app": Tensors(mask=torch.full((4,), -math.inf))}, block=True)
    assert layout.latest_consistent(tmp_path).step == 1


def test_a_format_without_nan_or_infinity_is_saved_unconverted(tmp_path):
    # float4_e2m1fn_x2 encodes neither, and torch has no kernel to convert it: every byte is finite.
    packed = torch.arange(256, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with CheckpointEngine(tmp_path) as engine:
        engine.save(1, {"app": Tensors(w=packed)}, block=True)
    assert layout.latest_consistent(tmp_path).step == 1
