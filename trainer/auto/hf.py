"""A Hugging Face `Trainer` under auto-instrumentation: ftsup's callback added (heartbeats, phases, the supervisor's
save and stop requests, commits into the store) and the newest committed checkpoint passed to `train` when the script
passes none (docs/hf.md, Without a line changed).
"""

from __future__ import annotations

import functools
import weakref
from types import ModuleType
from typing import Any

from ftsup.trainer.auto.contain import Piece, warn
from ftsup.trainer.runtime import runtime_taken

HF = Piece("the Hugging Face Trainer's callback")
_ours: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # Trainer -> the FtsupCallback added to it


def instrument(module: ModuleType) -> None:
    """Called once `transformers.trainer` is imported: `Trainer.__init__` and `Trainer.train` wrapped (subclasses
    that call them included)."""
    trainer_class = module.Trainer
    original_train = trainer_class.train

    @functools.wraps(original_train)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = HF.run(resume_point, self, args, kwargs)
        if given is not None:
            args, kwargs = given
        return original_train(self, *args, **kwargs)

    HF.after_init(trainer_class, adopt)
    trainer_class.train = train


def adopt(trainer: Any) -> Any:
    """Add an FtsupCallback to `trainer` (returned), unless the script asked for ftsup itself (one of its callbacks,
    `runtime()`) or the Trainer's arguments are ones the callback cannot serve (then one warning says why)."""
    from ftsup.trainer.hf.callback import FtsupCallback, unsupported

    if runtime_taken() or any(isinstance(cb, FtsupCallback) for cb in trainer.callback_handler.callbacks):
        return None
    why = unsupported(trainer.args)
    if why is not None:
        warn(f"the Trainer runs without ftsup's callback (no resume from the store, no emergency save): {why}")
        return None
    callback = FtsupCallback(keep_last=trainer.args.save_total_limit or 3)
    trainer.add_callback(callback)
    callback.on_init_end(trainer.args, trainer.state, trainer.control, model=trainer.model)  # it missed the event
    _ours[trainer] = callback
    return callback


def resume_point(
    trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments of `trainer.train(*args, **kwargs)` with the newest committed checkpoint as
    `resume_from_checkpoint` when the call gives none (or True: the newest); None to call it as it came."""
    callback = _ours.get(trainer)
    if callback is None:
        return None
    given = args[0] if args else kwargs.get("resume_from_checkpoint")
    if given is not None and given is not True:  # a path the script chose, or False: its own decision
        return None
    latest = callback.latest_checkpoint()
    if latest is None:
        return None
    if args:
        return (latest, *args[1:]), kwargs
    return args, {**kwargs, "resume_from_checkpoint": latest}
