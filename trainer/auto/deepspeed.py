"""A DeepSpeed engine under auto-instrumentation: its steps as heartbeats, the supervisor's requests served, each tag
it saves committed in the store, and `load_checkpoint` without a tag sent to the newest whole checkpoint
(`ftsup.trainer.deepspeed.supervise`; docs/deepspeed.md)."""

from __future__ import annotations

import functools
import inspect
import weakref
from types import ModuleType
from typing import Any

from ftsup.protocol import Phase
from ftsup.trainer.auto.contain import Piece, warn
from ftsup.trainer.runtime import runtime_taken

DEEPSPEED = Piece("the DeepSpeed engine's supervision")
_ours: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # engine -> its EngineSupervision


def instrument(module: ModuleType) -> None:
    """Called once `deepspeed.runtime.engine` is imported: `DeepSpeedEngine.__init__`, `step`, `save_checkpoint`,
    `load_checkpoint`, `train` and `eval` wrapped."""
    cls = module.DeepSpeedEngine
    original_step = cls.step
    original_save, original_load = cls.save_checkpoint, cls.load_checkpoint
    original_train, original_eval = cls.train, cls.eval
    save_signature = inspect.signature(original_save)
    load_signature = inspect.signature(original_load)

    @functools.wraps(original_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        ours = _ours.get(self)
        if ours is not None and DEEPSPEED.run(self.is_gradient_accumulation_boundary):
            DEEPSPEED.run(ours.stepping, self, original_save)
        before = self.global_steps
        result = original_step(self, *args, **kwargs)
        if ours is not None:
            DEEPSPEED.run(ours.stepped, self, before)
        return result

    @functools.wraps(original_save)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        ours = _ours.get(self)
        if ours is None:
            return original_save(self, *args, **kwargs)
        with ours.phase(Phase.SAVE, self.global_steps):
            result = original_save(self, *args, **kwargs)
        bound = DEEPSPEED.run(_bind, save_signature, self, args, kwargs)
        if bound is not None:
            a = bound.arguments
            DEEPSPEED.run(ours.saved, self, a["save_dir"], a.get("tag"), a.get("client_state", {}))
        return result

    @functools.wraps(original_load)
    def load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        ours = _ours.get(self)
        bound = DEEPSPEED.run(_bind, load_signature, self, args, kwargs) if ours is not None else None
        if ours is None or bound is None or bound.arguments.get("tag") is not None:
            return original_load(self, *args, **kwargs)  # an explicit tag is the script's own decision
        point = DEEPSPEED.run(ours.resume_point, bound.arguments["load_dir"])
        if point is None:
            return original_load(self, *args, **kwargs)
        if point is False:
            return None, None  # nothing whole to load: DeepSpeed's own answer when there is no checkpoint
        bound.arguments["load_dir"], bound.arguments["tag"] = point
        with ours.phase(Phase.LOAD, self.global_steps):
            return original_load(*bound.args, **bound.kwargs)

    @functools.wraps(original_train)
    def train(self: Any, mode: bool = True) -> Any:
        result = original_train(self, mode)
        ours = _ours.get(self)
        if ours is not None:
            DEEPSPEED.run(ours.switched, self, bool(mode))
        return result

    @functools.wraps(original_eval)
    def eval(self: Any) -> Any:
        result = original_eval(self)
        ours = _ours.get(self)
        if ours is not None:
            DEEPSPEED.run(ours.switched, self, False)
        return result

    DEEPSPEED.after_init(cls, adopt)
    cls.step, cls.train, cls.eval = step, train, eval
    cls.save_checkpoint, cls.load_checkpoint = save_checkpoint, load_checkpoint


def adopt(engine: Any) -> Any:
    """Supervise `engine` (the supervision returned), unless the script asked for ftsup itself (`runtime()`) or the
    engine is one whose saves cannot be committed (then one warning says why)."""
    from ftsup.trainer.deepspeed.supervise import EngineSupervision, unsupported

    if runtime_taken():
        return None
    why = unsupported(engine)
    if why is not None:
        warn(f"the DeepSpeed engine runs without ftsup's supervision (no resume from the store): {why}")
        return None
    _ours[engine] = ours = EngineSupervision(engine)
    return ours


def _bind(signature: inspect.Signature, engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = signature.bind(engine, *args, **kwargs)
    bound.apply_defaults()
    return bound
