"""`FtsupLightningCallback`: a Lightning `Trainer` under ftsup: heartbeats and phases, the supervisor's save and stop
requests, every checkpoint the Trainer saves committed in the store, and the newest to resume from.

The callback is made for the Lightning the Trainer comes from (`lightning.pytorch` or `pytorch_lightning`:
`callback_class`). How it saves and resumes, and what a resume restores: docs/lightning.md.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ftsup.protocol import Phase
from ftsup.store.errors import CheckpointError
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer import rng
from ftsup.trainer.hf import store
from ftsup.trainer.runtime import RuntimeClient, agree, cpu_group, runtime

log = structlog.get_logger("ftsup.trainer")

FORMAT = "lightning-trainer"
"""The manifest metadata's `format` of a checkpoint this callback committed: Lightning's `.ckpt` file and each rank's
random streams."""
CKPT_NAME = "model.ckpt"


def _rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


class LightningCallbackCore:
    """What `FtsupLightningCallback` does, apart from the Lightning it subclasses the `Callback` of."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        *,
        keep_last: int = 3,
        exit_on_stop: bool = True,
        client: RuntimeClient | None = None,
    ) -> None:
        """`checkpoint_dir`: the store (default: `FTSUP_CHECKPOINT_DIR`, which `ftsup run` exports as
        `checkpoint.dir`, else `<default_root_dir>/ftsup-checkpoints`). `exit_on_stop`: after the save a stop request
        asked for, `fit` ends the process with status 0 (the run is not finished: the supervisor relaunches later)."""
        self.retention = RetentionPolicy(keep_last=keep_last).with_environment(os.environ)
        self.exit_on_stop = exit_on_stop
        self.rt = client if client is not None else runtime()
        self._dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._root_dir: Path | None = None
        self.stopped = False
        """Training was stopped by the supervisor (an eviction): the run is not finished."""
        self.resumed: tuple[Path, int] | None = None
        """The committed checkpoint `latest_checkpoint` chose (its directory and step)."""
        self._handled = 0
        self._saving = False
        self._rank_state: dict[str, Any] | None = None
        self._phase = contextlib.ExitStack()
        self._last_step_at: float | None = None
        self._load_t0 = 0.0

    # ------------------------------------------------------------------ the store and resume

    @property
    def checkpoint_dir(self) -> Path:
        default = None if self._root_dir is None else self._root_dir / "ftsup-checkpoints"
        unknown = "FtsupLightningCallback: pass it to Trainer(callbacks=[...]) first, or give it a dir"
        return store.callback_store(self._dir, self.rt, default, unknown)

    def latest_checkpoint(self) -> str | None:
        """The `ckpt_path` to pass to `trainer.fit`: the newest deep-verified checkpoint of at most the supervisor's
        resume step; None for a fresh start."""
        self._load_t0 = time.monotonic()
        info, _ = store.resume_choice(self.checkpoint_dir, self.rt, format=FORMAT)
        if info is None:
            return None
        self.resumed = (Path(info.path), info.step)
        self.rt.beat(info.step, Phase.LOAD)  # Lightning loads it next: silent up to save_timeout_s
        return str(Path(info.path) / CKPT_NAME)

    # ------------------------------------------------------------------ Lightning's events

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._root_dir = Path(trainer.default_root_dir)
        if stage == "fit" and not getattr(trainer.save_checkpoint, "_ftsup_mirror", False):
            trainer.save_checkpoint = _mirrored(trainer.save_checkpoint, self, trainer)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """This rank's random streams as they were at the save, before Lightning makes the epoch's data iterator
        (an epoch-end checkpoint's next draw): only from a checkpoint `latest_checkpoint` chose, of this world size."""
        if self.resumed is None:
            return
        path = self.resumed[0] / _rank_file(trainer.global_rank)
        try:
            saved = torch.load(path, weights_only=True)
        except FileNotFoundError:
            return
        if saved.get("world_size") == trainer.world_size:
            rng.restore(saved["rng"])

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.resumed is not None and trainer.global_rank == 0:
            log.info("checkpoint_loaded", step=self.resumed[1], duration_s=round(time.monotonic() - self._load_t0, 4))
        self._last_step_at = time.monotonic()
        self.rt.beat(trainer.global_step, Phase.TRAIN)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        figures = {} if self._last_step_at is None else {"step_s": now - self._last_step_at}
        self._last_step_at = now
        self.rt.beat(trainer.global_step, Phase.TRAIN, **figures)
        request = agree(self.rt.control.poll())  # every rank, every batch
        if request.seq > self._handled:
            self._handled = request.seq
            self.save(trainer, "emergency")
            if request.stop:
                trainer.should_stop = True
                self.stopped = True
        self._last_step_at = time.monotonic()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._phase.close()
        self._phase.enter_context(self.rt.phase(Phase.EVAL, trainer.global_step))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._phase.close()
        self._last_step_at = time.monotonic()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._rank_state = {"rng": rng.capture(), "world_size": trainer.world_size}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._phase.close()
        self.rt.beat(trainer.global_step, Phase.DONE)
        if self.stopped and self.exit_on_stop:
            sys.stdout.flush()
            sys.stderr.flush()
            raise SystemExit(0)  # asked to stop: the checkpoint is in, the run is not finished

    # ------------------------------------------------------------------ saves

    def save(self, trainer: Any, kind: str) -> None:
        """Save and commit the Trainer's state now (every rank, at the same step): `emergency` for a request."""
        staging = self._staging(trainer)
        if staging is None:
            return
        self._saving = True
        try:
            with self.rt.phase(Phase.SAVE, trainer.global_step):
                trainer.save_checkpoint(staging / CKPT_NAME)
        finally:
            self._saving = False
        self._commit(trainer, staging, kind)

    def mirror(self, trainer: Any, filepath: str | os.PathLike[str], weights_only: bool) -> None:
        """After the Trainer saved `filepath` itself (ModelCheckpoint's saves; every rank): the same file committed
        in the store, linked when it can be. A weights-only file is not one to resume from: left alone."""
        if self._saving or weights_only:
            return
        staging = self._staging(trainer)
        if staging is not None:
            self._commit(trainer, staging, "periodic", take=Path(filepath))

    def _staging(self, trainer: Any) -> Path | None:
        """An empty directory of the store for the checkpoint of this step, the same on every rank; None (on every
        rank, the failure logged) when rank 0 cannot make it."""
        staging = self.checkpoint_dir / f"lightning-{trainer.global_step}.tmp"
        error = None
        if trainer.global_rank == 0:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            except OSError as e:
                error = f"cannot make {staging}: {e}"
                log.error("checkpoint_save_failed", step=trainer.global_step, reason=error)
        return staging if self._all(trainer, error is None) else None

    def _commit(self, trainer: Any, staging: Path, kind: str, take: Path | None = None) -> None:
        """Each rank's random streams into `staging` (and rank 0 takes the Trainer's file `take` there), then rank 0
        commits it as `step-N` of the store; every rank learns whether it is in."""
        step, rank = trainer.global_step, trainer.global_rank
        t0 = time.monotonic()
        error: str | None = None
        try:
            if take is not None and rank == 0:
                _link_or_copy(take, staging / CKPT_NAME)
            if self._rank_state is not None:
                torch.save(self._rank_state, staging / _rank_file(rank))
        except (OSError, CheckpointError) as e:
            error = f"rank {rank}: {e}"
        ready = self._all(trainer, error is None)  # every rank's files are in `staging`
        store.commit_agreed(
            self.rt,
            staging,
            self.checkpoint_dir,
            step,
            kind=kind,
            leader=rank == 0,
            agree=functools.partial(self._all, trainer),
            world_size=trainer.world_size,
            metadata={"world_size": trainer.world_size, "epoch": trainer.current_epoch, "global_step": step},
            policy=self.retention,
            started=t0,
            format=FORMAT,
            error=error if ready else error or store.ANOTHER_RANK,
        )
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)

    def _all(self, trainer: Any, ok: bool) -> bool:
        """Whether `ok` holds on every rank (an all-reduce on a gloo group; also a barrier)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group())
        return bool(flag.item())


def _mirrored(save_checkpoint: Any, callback: LightningCallbackCore, trainer: Any) -> Any:
    """The Trainer's `save_checkpoint`, followed by the callback's commit of what it saved."""

    @functools.wraps(save_checkpoint)
    def saved(filepath: str | os.PathLike[str], weights_only: bool = False, storage_options: Any = None) -> None:
        save_checkpoint(filepath, weights_only, storage_options)
        callback.mirror(trainer, filepath, weights_only)

    saved._ftsup_mirror = True  # type: ignore[attr-defined]
    return saved


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise CheckpointError(f"cannot take {src} into the store: {e}") from None
        shutil.copyfile(src, dst)


_classes: dict[type, type] = {}


def callback_class(callback_base: type) -> type:
    """`FtsupLightningCallback` for the Lightning whose `Callback` is `callback_base` (one class per base)."""
    if callback_base not in _classes:
        _classes[callback_base] = type("FtsupLightningCallback", (LightningCallbackCore, callback_base), {})
    return _classes[callback_base]


def __getattr__(name: str) -> Any:
    """`FtsupLightningCallback`: the class for `lightning.pytorch` when it is installed, else `pytorch_lightning`."""
    if name != "FtsupLightningCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from lightning.pytorch import Callback
    except ModuleNotFoundError:
        try:
            from pytorch_lightning import Callback
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"FtsupLightningCallback needs {e.name!r} (pip install lightning, or pytorch-lightning)", name=e.name
            ) from None
    return callback_class(Callback)
