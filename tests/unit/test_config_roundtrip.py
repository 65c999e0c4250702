"""A model configuration saved with a checkpoint matches itself after a resume, whatever form it was
given in (`ftsup.trainer.modelconfig`): a `transformers` `PretrainedConfig`, its `to_dict()` (int
keys in `id2label`), tuples, nested mappings. Fields naming software versions never refuse a
resume; a real difference names the key and both values. Real saves and loads, one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config

from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointMismatchError
from ftsup.trainer.data import GlobalBatchSchedule
from ftsup.trainer.modelconfig import ConfigError, canonical
from ftsup.trainer.state import TrainingState


def gpt2(**overrides: Any) -> GPT2Config:
    settings: dict[str, Any] = {
        "vocab_size": 64,
        "n_positions": 16,
        "n_embd": 16,
        "n_layer": 1,
        "n_head": 2,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    return GPT2Config(**settings | overrides)


FORMS = {
    "PretrainedConfig": gpt2,
    "its to_dict()": lambda: gpt2().to_dict(),
    "int keys and tuples": lambda: {"id2label": {0: "a", 1: "b"}, "sizes": (16, (4, 4)), "nested": {2: {3: (1,)}}},
}


def state(config: Any) -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    schedule = GlobalBatchSchedule(64, global_batch=4, micro_batch=4, world_size=1, rank=0, seed=0)
    return TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule=schedule, config=config)


def save_at_step_3(directory: Path, config: Any) -> None:
    first = state(config)
    assert first.schedule is not None
    first.step, first.samples = 3, first.schedule.position_after(3)
    with CheckpointEngine(directory) as engine:
        first.save(engine, block=True)


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_each_form_of_a_config_resumes_after_a_save(tmp_path, form):
    save_at_step_3(tmp_path, form())
    again = state(form())  # a new object of the same configuration, as a restarted process builds it
    with CheckpointEngine(tmp_path) as engine:
        result = again.resume(engine)
    assert (result is not None, again.step) == (True, 3)


def test_a_changed_hidden_size_is_refused_naming_the_key_and_both_values(tmp_path):
    save_at_step_3(tmp_path, gpt2())
    with CheckpointEngine(tmp_path) as engine, pytest.raises(CheckpointMismatchError) as refused:
        state(gpt2(n_embd=32)).resume(engine, step=3)
    assert "config.n_embd: checkpoint 16 != this run 32" in str(refused.value)
    assert refused.value.keys == ["config.n_embd"]


def test_a_software_version_in_the_config_never_refuses_a_resume(tmp_path):
    saved = gpt2().to_dict() | {"transformers_version": "4.0.0", "_name_or_path": "/old/place"}
    save_at_step_3(tmp_path, saved)
    with CheckpointEngine(tmp_path) as engine:
        assert state(gpt2()).resume(engine) is not None


def test_a_difference_deep_in_a_nested_config_names_its_path(tmp_path):
    save_at_step_3(tmp_path, {"text": {"layers": [1, 2]}})
    with CheckpointEngine(tmp_path) as engine, pytest.raises(CheckpointMismatchError) as refused:
        state({"text": {"layers": (1, 3)}}).resume(engine, step=3)
    assert refused.value.keys == ["config.text.layers"]


def test_a_value_without_a_json_form_is_refused_when_the_run_starts_naming_its_key():
    with pytest.raises(ConfigError, match=r"config\.model\.init: a value of type object"):
        state({"model": {"init": object()}})


def test_keys_that_json_would_merge_are_refused_when_the_run_starts():
    with pytest.raises(ConfigError, match="keys 1 and '1' are both '1' in JSON"):
        canonical({1: "a", "1": "b"})


def test_a_canonical_config_is_what_json_reads_back():
    assert canonical({1: (2.5, None), None: float("nan"), "d": torch.float16}) == {
        "1": [2.5, None],
        "null": "NaN",
        "d": "float16",
    }
