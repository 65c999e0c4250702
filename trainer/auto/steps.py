"""Progress from any script that steps a torch optimizer: each step of the first optimizer is a heartbeat, the trained
model's `.eval()` a phase `eval` until its `.train()`, a `torch.save` phase `save`.

docs/design/auto-instrumentation.md, Steps and phases.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ftsup.protocol import Phase, RuntimeEnv
from ftsup.trainer.auto import collectives
from ftsup.trainer.auto.contain import Piece
from ftsup.trainer.runtime import RuntimeClient, runtime_taken

STEPS = Piece("the optimizer-step heartbeats")


class Progress:
    """The rank's progress as its optimizer steps show it, sent on a client of its own. It stands down for good once
    anything else in the process asks for ftsup's runtime client (`taken()`: the script, a Session, a callback):
    from then on those beat, and this sends nothing."""

    def __init__(
        self,
        client: Callable[[], RuntimeClient] = lambda: RuntimeClient(RuntimeEnv.from_environ()),
        *,
        taken: Callable[[], bool] = runtime_taken,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_client = client
        self._client: RuntimeClient | None = None
        self._taken = taken
        self._mono = mono
        self._optimizer: weakref.ref[Any] | None = None
        self._params: frozenset[int] = frozenset()
        self._trains: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._phase = contextlib.ExitStack()
        self._in_eval = False
        self._last: float | None = None
        self.step = 0
        self._pid = os.getpid()
        self.active = True
        """False once stood down (`taken()`)."""

    @property
    def client(self) -> RuntimeClient:
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def stepped(self, optimizer: Any) -> bool:
        """After `optimizer.step()`: beat when it is the optimizer counted. True when this was a counted step."""
        if not self._still_active():
            return False
        counted = self._optimizer() if self._optimizer is not None else None
        if counted is None:  # the first optimizer to step, or the one counted is gone: this one counts from now on
            base = held_steps(optimizer) - 1 if self._optimizer is None else self.step
            self._optimizer = weakref.ref(optimizer)
            self._params = frozenset(id(p) for group in optimizer.param_groups for p in group["params"])
            self._trains = weakref.WeakKeyDictionary()
            self.step = max(self.step, base)
        elif counted is not optimizer:
            return False
        self.step += 1
        now = self._mono()
        figures = {} if self._last is None else {"step_s": now - self._last}
        self._last = now
        self.client.beat(self.step, Phase.TRAIN, **figures)
        return True

    def switched(self, module: Any, training: bool) -> None:
        """After `module.train(training)` called by the script (not from another module's): the trained model (or a
        wrapper of it) switched to eval enters phase `eval`, switched back to train leaves it."""
        if not self._still_active() or self._optimizer is None or training != self._in_eval:
            return
        if not self._is_trained_model(module):
            return
        if training:
            self._phase.close()
            self._in_eval = False
            self._restart_step_clock()  # the evaluation is not part of the next step's time
        else:
            self._phase.enter_context(self.client.phase(Phase.EVAL))
            self._in_eval = True

    def enter(self, phase: Phase) -> contextlib.ExitStack | None:
        """Enter a blocking phase (`save`) of a rank that has beaten: the stack to close when it ends; None
        (nothing entered) before the first step or once stood down."""
        if not self._still_active() or self._optimizer is None:
            return None
        stack = contextlib.ExitStack()
        stack.enter_context(self.client.phase(phase))
        stack.callback(self._restart_step_clock)
        return stack

    def done(self) -> None:
        """Training is over (the default process group destroyed, or the interpreter exiting): phase `done`, where
        torchrun's exit decides, so that a slow teardown is not taken for a hang."""
        if not self._still_active() or self._optimizer is None:
            return
        self._phase.close()
        self._in_eval = False
        self.client.beat(self.step, Phase.DONE)

    def _restart_step_clock(self) -> None:
        self._last = self._mono()

    def _is_trained_model(self, module: Any) -> bool:
        known = self._trains.get(module)
        if known is None:
            ids = {id(p) for p in module.parameters()}
            known = self._trains[module] = bool(self._params) and self._params <= ids
        return known

    def _still_active(self) -> bool:
        if os.getpid() != self._pid:  # a forked child (a data loader's worker): the rank's progress is not its own
            return False
        if self.active and self._taken():
            self.stand_down()
        return self.active

    def stand_down(self) -> None:
        """Send nothing more: the client is muted before its phase ends (the phase's closing beat goes nowhere), and
        its connection closed."""
        self.active = False
        if self._client is not None:
            self._client.env = dataclasses.replace(self._client.env, heartbeat_socket=None)
        self._phase.close()
        self._in_eval = False
        if self._client is not None:
            self._client.close()


def held_steps(optimizer: Any) -> int:
    """The steps an optimizer has taken by its own count (Adam's and its kin's `step` in the state of the first
    parameter that has one, which a script's own checkpoint restores), read once after a step; 1 when it keeps none."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if step is not None:
                try:
                    return max(1, int(step))
                except (TypeError, ValueError, RuntimeError):
                    return 1
    return 1


# ---------------------------------------------------------------------- installing it in torch

_depth = threading.local()  # inside a Module.train() call on this thread: the nested ones are the children's
_uninstall: list[Callable[[], None]] = []


def instrument(torch: Any) -> None:
    """Called once torch is imported: the optimizer hook, `Module.train`, `torch.save`; and the
    collective timeout (`collectives`)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    collectives.install(torch)
    progress = Progress()
    handle = register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: STEPS.run(_after_step, progress, optimizer)
    )
    original_train = torch.nn.Module.train

    @functools.wraps(original_train)
    def train(self: Any, mode: bool = True) -> Any:
        if getattr(_depth, "inside", False):
            return original_train(self, mode)
        _depth.inside = True
        try:
            result = original_train(self, mode)
        finally:
            _depth.inside = False
        STEPS.run(progress.switched, self, bool(mode))
        return result

    atexit.register(STEPS.run, progress.done)
    dist = torch.distributed
    if dist.is_available():
        dist.destroy_process_group = _done_first(dist.destroy_process_group, progress)
    original_save = torch.save
    torch.nn.Module.train = train
    torch.save = saving = _in_phase(original_save, progress, Phase.SAVE)

    def uninstall() -> None:
        handle.remove()
        if torch.nn.Module.train is train:
            torch.nn.Module.train = original_train
        if torch.save is saving:
            torch.save = original_save

    _uninstall.append(uninstall)


def _after_step(progress: Progress, optimizer: Any) -> None:
    progress.stepped(optimizer)
    if not progress.active:  # stood down: the hooks go, and with them their cost
        while _uninstall:
            _uninstall.pop()()


def _done_first(function: Callable[..., Any], progress: Progress) -> Callable[..., Any]:
    """`destroy_process_group` that, for the default group, first says training is over (`Progress.done`)."""

    @functools.wraps(function)
    def wrapped(group: Any = None) -> Any:
        if group is None:
            STEPS.run(progress.done)
        return function(group)

    return wrapped


def _in_phase(function: Callable[..., Any], progress: Progress, phase: Phase) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        entered = STEPS.run(progress.enter, phase)
        try:
            return function(*args, **kwargs)
        finally:
            if entered is not None:
                STEPS.run(entered.close)

    return wrapped
