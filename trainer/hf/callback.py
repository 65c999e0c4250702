"""`FtsupCallback`: a Hugging Face `transformers.Trainer` under ftsup, with one callback and one line to resume.

Heartbeats and phases, the supervisor's requests, commits into the store and the resume choice, through the
Trainer's public callback events only (docs/hf.md; trainer/checkpoint/DESIGN.md, The Trainer callback).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ModuleNotFoundError as e:  # `from ftsup import FtsupCallback` without the libraries it is for
    raise ModuleNotFoundError(
        f"ftsup.FtsupCallback needs {e.name!r} (pip install 'transformers>=5,<6' accelerate)", name=e.name
    ) from None

from ftsup.protocol import Phase
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer.hf import store as hf_store
from ftsup.trainer.runtime import RuntimeClient, agree, runtime

log = structlog.get_logger("ftsup.trainer")

_EVAL, _LOG, _SAVE = "eval", "log", "save"  # what the Trainer does after on_step_end, in this order


class FtsupCallback(TrainerCallback):
    """Heartbeats, eval-aware phases, the supervisor's save and stop requests, committed and verified
    checkpoints, exact resume (the module docstring says what each means)."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        *,
        keep_last: int = 3,
        keep_every: int | None = None,
        config: Any = None,
        exit_on_stop: bool = True,
        client: RuntimeClient | None = None,
    ) -> None:
        """`checkpoint_dir`: the store (default: `FTSUP_CHECKPOINT_DIR`, which `ftsup run` exports
        as `checkpoint.dir`, else the Trainer's `output_dir`); keep it on the filesystem of
        `output_dir`, so that a commit is a rename and not a copy. `config`: the model config
        saved in each checkpoint's metadata for `ftsup ckpt export-hf` (a `PretrainedConfig` or a
        JSON-able mapping; default: the model's own `config`)."""
        # At least the history a rollback past an anomaly needs (FTSUP_KEEP_OLDER_THAN_STEPS).
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every).with_environment(os.environ)
        self.exit_on_stop = exit_on_stop
        self.rt = client if client is not None else runtime()
        self._dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._config = _plain_config(config) if config is not None else None
        self.stopped = False
        """Training was stopped by the supervisor (an eviction): the run is not finished."""
        self.resumed_step: int | None = None
        self._args: TrainingArguments | None = None
        self._group: Any = None  # a gloo group for the few CPU collectives of a save
        self._handled = 0  # the newest request served
        self._emergency = False
        self._pending: set[str] = set()
        self._phase = Phase.TRAIN
        self._phase_cm = contextlib.ExitStack()
        self._save_t0 = 0.0
        self._load_t0 = 0.0

    # ------------------------------------------------------------------ set-up and resume

    @property
    def checkpoint_dir(self) -> Path:
        output_dir = None if self._args is None else Path(str(self._args.output_dir))
        unknown = "FtsupCallback: pass it to Trainer(callbacks=[...]) first, or give it checkpoint_dir"
        return hf_store.callback_store(self._dir, self.rt, output_dir, unknown)

    def latest_checkpoint(self) -> str | None:
        """The checkpoint to pass as `trainer.train(resume_from_checkpoint=...)`: the newest
        deep-verified one of at most the supervisor's resume step; None for a fresh start."""
        self._load_t0 = time.monotonic()
        info, passed = hf_store.resume_choice(self.checkpoint_dir, self.rt)
        if info is None and passed and self.rt.env.rank == 0:
            log.warning(
                "training_started_from_scratch", step=0, unusable=len(passed), reason="; ".join(map(str, passed))
            )
        if info is None:
            return None
        self.resumed_step = info.step
        self.rt.beat(info.step, Phase.LOAD)  # the Trainer loads it next: silent up to save_timeout_s
        return info.path

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        why = unsupported(args)
        if why is not None:
            raise ValueError(f"FtsupCallback cannot work with {why}; turn it off")
        self._args = args
        # train() opens with a full collection (accelerate's free_memory), which with transformers imported walks
        # every object of the process on every relaunch. What exists by now (modules, the model, the Trainer) lives
        # as long as the process: out of the collector's way, so that its collections walk only what training
        # allocates (trainer/checkpoint/DESIGN.md, The Trainer callback).
        gc.freeze()
        model_config = getattr(kwargs.get("model"), "config", None)
        if self._config is None and model_config is not None:
            self._config = _plain_config(model_config)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if self.resumed_step is not None:  # chosen, verified, loaded and set up by the Trainer
            log.info("checkpoint_loaded", step=self.resumed_step, duration_s=round(time.monotonic() - self._load_t0, 4))
        if self.resumed_step is not None and state.global_step >= state.max_steps and self.exit_on_stop:
            # Resumed from its last step, the Trainer would still take one more when max_steps ends
            # inside an epoch: the run is over, and an attempt after its final save only has to end.
            self.rt.beat(state.global_step, Phase.DONE)
            raise SystemExit(0)
        self.rt.beat(state.global_step, Phase.TRAIN)

    # ------------------------------------------------------------------ every step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        step = state.global_step
        self._pending.clear()
        self._set_phase(Phase.TRAIN, step)  # a phase whose closing event never came ends here
        self.rt.beat(step, Phase.TRAIN)
        request = agree(self.rt.control.poll(), args.device)  # every rank, every step
        if request.seq > self._handled:
            self._handled = request.seq
            self._emergency = True
            control.should_save = True
            control.should_evaluate = False  # the deadline is for the save
            if request.stop:
                control.should_training_stop = True
                self.stopped = True
        self._plan(args, state, control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._pending.clear()
        self._plan(args, state, control)  # epoch strategies log, evaluate and save after this event

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        logs = kw.get("logs") or {}
        loss = logs.get("loss")
        if isinstance(loss, (int, float)):
            self.rt.beat(state.global_step, None, loss=float(loss))
        if _LOG in self._pending:
            self._pending.discard(_LOG)
            self._next_phase(state.global_step)

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._phase == Phase.TRAIN:  # an evaluation no step announced
            self._pending.add(_EVAL)
            self._next_phase(state.global_step)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._pending.discard(_EVAL)
        self._next_phase(state.global_step)

    # ------------------------------------------------------------------ saves

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        step = state.global_step
        kind = "emergency" if self._emergency else "final" if step >= state.max_steps else "periodic"
        self._emergency = False
        self._all(True)  # every rank's files are written
        hf_store.commit_agreed(
            self.rt,
            hf_store.hf_checkpoint_dir(str(args.output_dir), step),
            self.checkpoint_dir,
            step,
            kind=kind,
            leader=args.process_index == 0,
            agree=self._all,
            world_size=args.world_size,
            metadata=self._metadata(args, state),
            policy=self.retention,
            started=self._save_t0,
            timed=True,
            logged={"world_size": args.world_size},
        )
        self._pending.discard(_SAVE)
        self._next_phase(step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        self._set_phase(Phase.TRAIN, state.global_step)
        self.rt.beat(state.global_step, Phase.DONE)
        if self.stopped and self.exit_on_stop:
            sys.stdout.flush()
            sys.stderr.flush()
            raise SystemExit(0)  # asked to stop: the checkpoint is in, the run is not finished

    # ------------------------------------------------------------------ helpers

    def _metadata(self, args: TrainingArguments, state: TrainerState) -> dict[str, Any]:
        return {
            "config": self._config or {},
            "world_size": args.world_size,
            "max_steps": state.max_steps,
            "epoch": state.epoch,
            "seed": args.seed,
            "global_batch": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
        }

    def _plan(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
        """What the Trainer does next, from the flags the callbacks left (every rank has the same)."""
        if control.should_evaluate:
            self._pending.add(_EVAL)
        if control.should_log and _sparse_logging(args, state):
            self._pending.add(_LOG)
        if control.should_save:
            self._pending.add(_SAVE)
            self._clear_stale(args, state.global_step)
        self._next_phase(state.global_step)

    def _next_phase(self, step: int) -> None:
        """The phase of what the Trainer does next: eval (logging, evaluation), then save, then train."""
        if _EVAL in self._pending or _LOG in self._pending:
            self._set_phase(Phase.EVAL, step)
        elif _SAVE in self._pending:
            if self._phase != Phase.SAVE:
                self._save_t0 = time.monotonic()
            self._set_phase(Phase.SAVE, step)
        else:
            self._set_phase(Phase.TRAIN, step)

    def _set_phase(self, phase: Phase, step: int) -> None:
        if phase == self._phase:
            return
        self._phase_cm.close()  # leaves the previous phase (back to train)
        self._phase_cm = contextlib.ExitStack()
        self._phase = phase
        if phase != Phase.TRAIN:
            self._phase_cm.enter_context(self.rt.phase(phase, step))

    def _clear_stale(self, args: TrainingArguments, step: int) -> None:
        """Rank 0 removes a `checkpoint-N/` that a torn save of this step left (committed ones are in
        the store), so that none of its files joins this save's; then no rank writes before it is gone."""
        if args.process_index == 0:
            stale = hf_store.hf_checkpoint_dir(str(args.output_dir), step)
            with contextlib.suppress(FileNotFoundError):
                if stale.is_symlink() or not stale.is_dir():
                    stale.unlink()
                else:
                    shutil.rmtree(stale)
        self._all(True)

    def _all(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (an all-reduce on a gloo group; also a barrier)."""
        if self._group is None:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())


def unsupported(args: TrainingArguments) -> str | None:
    """Why FtsupCallback cannot serve a Trainer of these arguments, or None when it can."""
    refused = [
        (args.save_only_model, "save_only_model=True saves no optimizer or RNG state to resume from"),
        (args.load_best_model_at_end, "load_best_model_at_end=True: the best checkpoint moves into the store"),
        (
            getattr(args, "enable_jit_checkpoint", False),
            "enable_jit_checkpoint=True: the supervisor owns SIGTERM and asks for the save itself",
        ),
    ]
    return next((why for bad, why in refused if bad), None)


def _sparse_logging(args: TrainingArguments, state: TrainerState) -> bool:
    """Logging that is not every step: its pause is a phase, not part of the step time."""
    return args.logging_strategy != "steps" or state.logging_steps != 1


def _plain_config(config: Any) -> dict[str, Any]:
    """A model config as config.json holds it: plain JSON (int keys become strings, tuples lists)."""
    if hasattr(config, "to_json_string"):
        plain = json.loads(config.to_json_string(use_diff=False))
    elif isinstance(config, Mapping):
        plain = json.loads(json.dumps(dict(config), default=str))
    else:
        raise TypeError(
            f"FtsupCallback(config=...) must be a PretrainedConfig or a mapping, not {type(config).__name__}"
        )
    return plain
