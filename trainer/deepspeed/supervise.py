"""A DeepSpeed engine under ftsup: its steps as heartbeats, the supervisor's requests served at a step, each tag it
saves committed in the store once every rank has written it, and a resume from the newest committed (else the newest
whole tag of the script's own directory). The hooks that call it: `ftsup.trainer.auto.deepspeed`; docs/deepspeed.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ftsup.protocol import SAVE_FAILED_STEP, Phase
from ftsup.store import layout
from ftsup.store.errors import CheckpointError
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer.deepspeed import tags
from ftsup.trainer.hf import store
from ftsup.trainer.runtime import RuntimeClient, agree, cpu_group, runtime

log = structlog.get_logger("ftsup.trainer")

FORMAT = "deepspeed"
"""The manifest metadata's `format` of a DeepSpeed tag committed in the store (its files as DeepSpeed wrote them)."""
EMERGENCY_TAG = "emergency"


def unsupported(engine: Any) -> str | None:
    """Why this engine's saves cannot be committed (None: they can)."""
    if type(engine).__name__ != "DeepSpeedEngine":
        return f"a {type(engine).__name__} (pipeline and other engines are left as they are)"
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or type(ce).__name__ != "TorchCheckpointEngine" or ce.is_decoupled():
        return (
            f"its checkpoint engine is {type(ce).__name__} (only TorchCheckpointEngine writes a tag before it returns)"
        )
    if engine.use_node_local_storage():
        return "use_node_local_storage: each node holds part of a tag"
    return None


class EngineSupervision:
    """What ftsup does for one DeepSpeed engine; every method is called on every rank at the same point."""

    def __init__(self, engine: Any, client: RuntimeClient | None = None, *, keep_last: int = 3) -> None:
        self.rt = client if client is not None else runtime()
        self.rank = engine.global_rank
        self.world_size = engine.world_size
        self.store = Path(self.rt.env.checkpoint_dir) if self.rt.env.checkpoint_dir else None
        self.retention = RetentionPolicy(keep_last=keep_last).with_environment(os.environ)
        self._handled = 0
        self._last_at: float | None = None
        self._saved_with: dict[str, Any] | None = None  # the client_state of the script's last save
        self._stepped = False
        self._eval = contextlib.ExitStack()
        self._in_eval = False
        self.stopped = False

    # ------------------------------------------------------------------ steps

    def stepping(self, engine: Any, original_save: Callable[..., Any]) -> None:
        """Before an `engine.step()` that ends a gradient accumulation: the supervisor's newest request, agreed by all
        ranks, served before the optimizer step, so that a save holds the last step whose code the script has run
        (its loss logged, its own save made)."""
        request = agree(self.rt.control.poll())
        if request.seq <= self._handled:
            return
        self._handled = request.seq
        self.emergency_save(engine, original_save)
        if request.stop:
            self.stopped = True
            self.rt.beat(engine.global_steps, Phase.DONE)
            sys.stdout.flush()
            sys.stderr.flush()
            raise SystemExit(0)  # asked to stop: the checkpoint is in, the run is not finished
        self._last_at = time.monotonic()

    def stepped(self, engine: Any, before: int) -> None:
        """After `engine.step()`: a heartbeat when it completed an optimizer step (a gradient accumulation ended)."""
        step = engine.global_steps
        if step == before:
            return
        now = time.monotonic()
        figures = {} if self._last_at is None else {"step_s": now - self._last_at}
        self.rt.beat(step, Phase.TRAIN, **figures)
        self._stepped = True
        self._last_at = now

    def switched(self, engine: Any, training: bool) -> None:
        """After `engine.train(mode)` or `engine.eval()`: once it has stepped, eval is phase `eval` (beaten from a
        thread) until `train()`."""
        if not self._stepped or training != self._in_eval:
            return
        if training:
            self._eval.close()
            self._last_at = time.monotonic()
        else:
            self._eval.enter_context(self.rt.phase(Phase.EVAL, engine.global_steps))
        self._in_eval = not training

    @contextlib.contextmanager
    def phase(self, phase: Phase, step: int) -> Iterator[None]:
        with self.rt.phase(phase, step):
            yield
        self._last_at = time.monotonic()

    # ------------------------------------------------------------------ saves

    def saved(self, engine: Any, save_dir: Any, tag: Any, client_state: Any) -> None:
        """After the script's `save_checkpoint(save_dir, tag)` returned on every rank (DeepSpeed's last barrier): the
        tag committed in the store as `step-N`."""
        self._saved_with = dict(client_state) if isinstance(client_state, dict) else {}
        if self.store is None:
            return
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
        self._commit(engine, Path(save_dir) / tag, "periodic", tag)

    def emergency_save(self, engine: Any, original_save: Callable[..., Any]) -> None:
        """The save a request asked for, where the script's position is DeepSpeed's own: the script has saved, and with
        no client_state of its own, so a tag of this step without one resumes it where it is."""
        step = engine.global_steps
        why = None
        if self.store is None:
            why = "no checkpoint store"
        elif self._saved_with is None:
            why = "the script has not saved yet: what its resume reads from a checkpoint is not known"
        elif self._saved_with:
            keys = ", ".join(sorted(map(str, self._saved_with)))[:80]
            why = f"the script keeps its own state in client_state ({keys}), which a save now would carry stale"
        if why is not None:
            if self.rank == 0:
                log.warning("emergency_save_skipped", step=step, reason=why)
            self.rt.beat(step, None, **{SAVE_FAILED_STEP: step})
            return
        assert self.store is not None
        root = self.store / f"deepspeed-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        with self.phase(Phase.SAVE, step):
            original_save(engine, str(root), tag=EMERGENCY_TAG, client_state={}, save_latest=False)
        self._commit(engine, root / EMERGENCY_TAG, "emergency", EMERGENCY_TAG)
        if self.rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    def _commit(self, engine: Any, src: Path, kind: str, tag: str) -> None:
        assert self.store is not None
        store.commit_agreed(
            self.rt,
            src,
            self.store,
            engine.global_steps,
            kind=kind,
            leader=self.rank == 0,
            agree=self._all,
            world_size=self.world_size,
            metadata={"tag": tag, "zero_stage": engine.zero_optimization_stage(), "world_size": self.world_size},
            policy=self.retention,
            started=time.monotonic(),
            format=FORMAT,
            check=tags.check_tag,  # what a resume will check, checked now: a tag DeepSpeed left incomplete stays out
        )

    # ------------------------------------------------------------------ resume

    def resume_point(self, load_dir: Any) -> tuple[str, str] | None | bool:
        """Where the script's `load_checkpoint(load_dir)` (no tag: DeepSpeed's `latest`) should load from, chosen by
        rank 0 and the same on every rank: (dir, tag) of the newest committed checkpoint in the store (of at most the
        supervisor's resume step), else of the newest whole tag of `load_dir`; False: nothing whole to load (a fresh
        start, as DeepSpeed's own without a `latest`)."""
        choice: list[Any] = [None]
        if self.rank == 0:
            choice[0] = self._choose(Path(load_dir))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(choice, src=0, group=cpu_group())
        return choice[0]  # type: ignore[no-any-return]

    def _choose(self, load_dir: Path) -> tuple[str, str] | bool:
        if self.store is not None:
            try:
                info, passed = store.latest_hf_checkpoint(
                    self.store, at_most=self.rt.env.resume_bound, quarantine=True, format=FORMAT
                )
            except CheckpointError as e:
                log.warning("deepspeed_store_refused", path=str(self.store), reason=str(e))
                info, passed = None, ()
            store.tell_passed(passed)
            if info is not None:
                log.info("deepspeed_tag_chosen", step=info.step, path=info.path, source="store")
                return str(self.store), layout.step_dirname(info.step)
        tag, skipped = tags.newest_whole(load_dir)
        for s in skipped:
            log.warning("deepspeed_tag_passed_over", tag=s.tag, path=str(load_dir), reason=s.reason)
        if tag is None:
            return False
        log.info("deepspeed_tag_chosen", step=tag.global_steps, path=str(tag.path), source="save_dir")
        return str(load_dir), tag.path.name

    def _all(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (an all-reduce on a gloo group; also a barrier)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group())
        return bool(flag.item())
