"""The Hugging Face Trainer under auto-instrumentation, apart from a run (tests/integration/test_zero_line_hf.py has
those): a Trainer whose arguments FtsupCallback cannot serve is left as it was, with one warning saying why, and a
Trainer that was not given the callback is resumed as the script asked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import TrainingArguments

from ftsup.trainer.auto import hf


class FakeTrainer:
    """What the wrappers read of a `transformers.Trainer`: its arguments and its callbacks."""

    def __init__(self, args: TrainingArguments) -> None:
        self.args = args
        self.callback_handler = SimpleNamespace(callbacks=[])


def trainer(tmp_path, **args):  # type: ignore[no-untyped-def]
    return FakeTrainer(TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, **args))


@pytest.fixture(autouse=True)
def script_without_ftsup(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's runtime client not asked for, whatever another test in this process did."""
    monkeypatch.setattr(hf, "runtime_taken", lambda: False)


@pytest.mark.parametrize(
    ("args", "why"),
    [({"save_only_model": True}, "save_only_model=True"), ({"load_best_model_at_end": True}, "load_best_model_at_end")],
)
def test_a_trainer_the_callback_cannot_serve_is_left_as_it_was_with_one_warning(tmp_path, args, why):
    t = trainer(tmp_path, **args, eval_strategy="steps", save_strategy="steps")
    with pytest.warns(RuntimeWarning, match=f"runs without ftsup's callback .*{why}"):
        added = hf.adopt(t)
    assert (added, t.callback_handler.callbacks) == (None, [])


def test_a_trainer_without_the_callback_is_resumed_as_the_script_asked(tmp_path):
    t = trainer(tmp_path)
    assert hf.resume_point(t, (), {"resume_from_checkpoint": None}) is None
