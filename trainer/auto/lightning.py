"""A Lightning `Trainer` under auto-instrumentation: ftsup's callback added (heartbeats, phases, the supervisor's save
and stop requests, the Trainer's checkpoints committed in the store) and the newest committed checkpoint passed to
`fit` when the script passes none (docs/lightning.md)."""

from __future__ import annotations

import functools
import inspect
import weakref
from types import ModuleType
from typing import Any

from ftsup.trainer.auto.contain import Piece
from ftsup.trainer.runtime import runtime_taken

LIGHTNING = Piece("the Lightning Trainer's callback")
_ours: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # Trainer -> the callback added to it


def instrument(package: ModuleType) -> None:
    """Called once `lightning.pytorch` or `pytorch_lightning` is imported: its `Trainer.__init__` and `Trainer.fit`
    wrapped."""
    trainer_class, callback_base = package.Trainer, package.Callback
    original_fit = trainer_class.fit
    fit_signature = inspect.signature(original_fit)

    @functools.wraps(original_fit)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = LIGHTNING.run(resume_point, self, fit_signature, args, kwargs)
        if given is not None:
            args, kwargs = given
        return original_fit(self, *args, **kwargs)

    LIGHTNING.after_init(trainer_class, adopt, callback_base)
    trainer_class.fit = fit


def adopt(trainer: Any, callback_base: type) -> Any:
    """Add an FtsupLightningCallback to `trainer` (returned), unless the script asked for ftsup itself (the callback,
    `runtime()`)."""
    from ftsup.trainer.lightning.callback import LightningCallbackCore, callback_class

    if runtime_taken() or any(isinstance(cb, LightningCallbackCore) for cb in trainer.callbacks):
        return None
    callback = callback_class(callback_base)()
    trainer.callbacks.append(callback)
    _ours[trainer] = callback
    return callback


def resume_point(
    trainer: Any, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments of `trainer.fit(*args, **kwargs)` with the newest committed checkpoint as `ckpt_path` when the
    call gives none (or "last"); None to call it as it came."""
    callback = _ours.get(trainer)
    if callback is None:
        return None
    try:
        bound = signature.bind(trainer, *args, **kwargs)
    except TypeError:  # the script's own mistake: the call goes as it came, for Lightning to say so
        return None
    if bound.arguments.get("ckpt_path") not in (None, "last"):
        return None
    latest = callback.latest_checkpoint()
    if latest is None:
        return None
    bound.arguments["ckpt_path"] = latest
    return bound.args[1:], bound.kwargs
