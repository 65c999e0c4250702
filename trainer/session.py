"""Session: the bookkeeping of a training loop that resumes exactly, in one object.

    from ftsup import Session

    session = Session(model, optimizer, scheduler, dataset, global_batch=32, micro_batch=4, config=model_config)
    for step in session.steps(total_steps):      # from the step after the latest checkpoint
        total = 0
        for batch in session.micro_batches():    # this rank's share of the global batch
            loss = model(**batch).loss
            (loss / session.accumulation_steps).backward()
            total += loss.detach()
        check = session.clip_and_step(1.0, total / session.accumulation_steps)  # refused when not finite
        log_loss(step, check.mean_loss)          # on the host already: no .item() needed
        if step % eval_every == 0:
            with session.phase("eval"):          # a long pause that is not a hang
                evaluate(model)

What it does, so that the loop does not:

- **Resume.** Constructing it (every rank, after `init_process_group`) makes the checkpoint engine
  (`ckpt_dir`, by default `FTSUP_CHECKPOINT_DIR`, which `ftsup run` sets from `checkpoint.dir`),
  the `TrainingState`, and loads the latest consistent checkpoint of at most the supervisor's
  choice (`FTSUP_RESUME_STEP`) in phase `load`, from the durable tier when only it holds that one
  (`FTSUP_CHECKPOINT_DURABLE`, set from `checkpoint.durable`: a new machine resumes from there).
  A checkpoint of another configuration is refused before anything is loaded, naming the key
  (`config=`, see `ftsup.trainer.modelconfig`). A fresh run
  (no checkpoint yet) given `init_from_hf=DIR` starts from a Hugging Face Hub-layout model's weights,
  each rank reading only its share (`ftsup.trainer.hf.load`).
- **Data.** `micro_batches()` yields this rank's micro-batches of the step from `dataset` in the
  world-size-independent order of a `GlobalBatchSchedule` (or, given only a `schedule`, the
  `MicroBatch` descriptions themselves). Gradients are synchronised only on the step's last
  micro-batch (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`).
- **Randomness.** Every source it hands out is seeded from the run's `seed`, never from a stream a
  resume would have to restore: the loader has a generator of its own (so `iter(DataLoader)`
  draws nothing from torch's global stream), and torch's global generators (CPU and every CUDA
  device: dropout) are seeded before each micro-batch from (seed, step, the micro-batch's first
  global sample). A run resumed on the same world size is therefore bitwise the uninterrupted
  one, and on another world size the same up to the order of float reductions.
- **The step guard.** `clip_and_step(max_norm, loss)` clips, checks and steps the optimizer and
  the scheduler; `step_guard(loss, grad_norm)` only checks, between the loop's clipping and its own
  `optimizer.step()`. Either refuses, on every rank alike, the update of a step whose loss (on any
  rank) or gradient norm is not finite: nothing a checkpoint holds changes (`ftsup.trainer.stepguard`),
  and the step's heartbeat says `step_skipped`. It costs one host-device synchronisation per step
  on a GPU (the one copy of loss and norm it returns, which a loop can log without an `.item()`).
- **Data skips.** Ranges of global data positions never served: `skip=` for a fresh run told to
  skip, `FTSUP_DATA_SKIPS` (set by the supervisor after a rollback) and the resumed checkpoint's,
  all together (`TrainingState`); every checkpoint records them.
- **Heartbeats.** One per step (phase `train`, the step, its duration `step_s`, the data position
  after it `samples`, the guard's `loss`, `grad_norm` and `step_skipped`, this rank's own work
  `compute_s` (`_OwnWork`), and the figures given to `report`); `phase("eval")` keeps beating
  from a thread through a long pause, for at most its own `timeout_s` when given (then the rank
  goes silent and the supervisor's heartbeat timeout catches a hang), `keepalive()` beats once in
  phase `eval`. Every save's duration is reported by the engine itself.
- **Saves and requests.** A periodic save every `save_every` steps (asynchronous: the step waits
  only for the copy), the final one after the last step; the supervisor's save and stop requests
  are agreed by all ranks with an all-reduce on a CPU group overlapped with the next step
  (`ftsup.trainer.runtime.Agreement`), so each is acted on one step after it was read, at the same
  step on every rank: an emergency save (blocking, reported with `saved_step`; `fallback_step` when
  the engine wrote it into its fallback directory, `save_failed_step` when it failed), then, for a
  stop, the loop ends (`stopped`). Then the engine is closed and the rank beats `done`.

A loop left early (a `break`, an exception) waits for nothing: call `close()` on every rank to
finish the saves in flight. Not here: the checkpoint format (`ftsup.trainer.checkpoint`), the
supervisor's channel (`ftsup.trainer.runtime`), the data order (`ftsup.trainer.data`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ftsup.protocol import FALLBACK_STEP, SAVE_FAILED_STEP, SAVED_STEP, Request
from ftsup.store.errors import CheckpointSaveError
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer import rng
from ftsup.trainer.checkpoint.engine import CheckpointEngine, LoadResult
from ftsup.trainer.data import DataConfigError, GlobalBatchSchedule, MicroBatch, RankBatchSampler
from ftsup.trainer.hf.load import HfInit
from ftsup.trainer.runtime import Agreement, RuntimeClient, runtime
from ftsup.trainer.state import TrainingState
from ftsup.trainer.stepguard import StepCheck

log = structlog.get_logger("ftsup.trainer")

DEFAULT_SAVE_EVERY = 100


class Session:
    """A training loop's bookkeeping: resume, data, seeds, heartbeats, saves, the supervisor's requests.

    `dataset` (map-style) with `global_batch` and `micro_batch`, or a `schedule` (then `dataset` is
    optional: without one, `micro_batches()` yields `MicroBatch` descriptions). `collate_fn`,
    `num_workers` and `pin_memory` go to the DataLoader. `engine`: a CheckpointEngine of your own
    (then `ckpt_dir` and `keep_last` are not used). `save_every`: steps between periodic saves (None:
    none, only emergency and final ones). `seed` (default 0, or the schedule's): the data order's
    and the dropout seeds'. `skip`: ranges (A, B) of global data positions never to serve (with
    those of `FTSUP_DATA_SKIPS` and of the resumed checkpoint). `init_from_hf`: a Hugging Face Hub-layout
    model directory whose weights a fresh run starts from (`ftsup.trainer.hf.load`: each rank reads its
    share); a resumed run takes its checkpoint's, and every checkpoint records where they came from.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        dataset: Any = None,
        *,
        global_batch: int | None = None,
        micro_batch: int | None = None,
        schedule: GlobalBatchSchedule | None = None,
        seed: int | None = None,
        config: Any = None,
        ckpt_dir: str | os.PathLike[str] | None = None,
        save_every: int | None = DEFAULT_SAVE_EVERY,
        keep_last: int = 3,
        scaler: Any = None,
        collate_fn: Any = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        engine: CheckpointEngine | None = None,
        skip: Iterable[tuple[int, int]] = (),
        init_from_hf: str | os.PathLike[str] | None = None,
    ) -> None:
        if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every must be a number of steps >= 1 or None, not {save_every!r}")
        self.runtime: RuntimeClient = runtime()
        rt = self.runtime
        rt.beat(rt.env.resume_step or 0, "init")
        self.model = model
        self.dataset = dataset
        self.save_every = save_every
        self.schedule = self._schedule(dataset, global_batch, micro_batch, schedule, seed).with_skips(skip)
        self.seed = self.schedule.seed
        self.rank, self.world_size = self.schedule.rank, self.schedule.world_size
        self._loader_options = {"collate_fn": collate_fn, "num_workers": num_workers, "pin_memory": pin_memory}
        if engine is None:
            directory = ckpt_dir if ckpt_dir is not None else rt.env.checkpoint_dir
            if not directory:
                raise ValueError("Session needs a checkpoint directory: ckpt_dir=..., or FTSUP_CHECKPOINT_DIR "
                                 "(ftsup run sets it from checkpoint.dir)")  # fmt: skip
            engine = CheckpointEngine(directory, retention=RetentionPolicy(keep_last=keep_last))
        self.engine = engine
        try:
            self.state = TrainingState(model, optimizer, scheduler, scaler, schedule=self.schedule, config=config)
            with rt.phase("load"):
                self.loaded: LoadResult | None = self.state.resume(engine, at_most=rt.env.resume_step)
                self.hf_init: HfInit | None = None
                """What `init_from_hf` loaded (None: a checkpoint was resumed, or no Hugging Face model was given)."""
                if self.loaded is None and init_from_hf is not None:
                    t0 = time.monotonic()
                    self.hf_init = self.state.init_from_hf(init_from_hf)
                    took = round(time.monotonic() - t0, 4)
                    log.info("hf_model_loaded", rank=self.rank, path=self.hf_init.origin["dir"],
                             bytes_read=self.hf_init.bytes_read, duration_s=took)  # fmt: skip
            self.schedule = self.state.schedule  # with every skip in force
            self._agreement = Agreement()
        except BaseException:
            engine.close()  # its writer thread is ours; nothing was saved
            raise
        self.micro_batch: MicroBatch | None = None
        """The micro-batch `micro_batches()` yielded last (its step, index and sample ids)."""
        self.stopped = False
        """True once the loop ended because the supervisor asked the job to stop."""
        self._total: int | None = None
        self._current: int | None = None  # the step whose body runs now
        self._batches: Iterator[Any] | None = None
        self._handled = 0  # the newest request seq served
        self._figures: dict[str, Any] = {}
        self._deferred: list[tuple[str, torch.Tensor, Any]] = []  # figures still on their way from a device
        self._own_work = _OwnWork(any(p.is_cuda for p in model.parameters()))
        self._closed = False

    # ------------------------------------------------------------------ what the loop uses

    @property
    def step(self) -> int:
        """Optimizer steps completed (and saved in the state)."""
        return self.state.step

    @property
    def accumulation_steps(self) -> int:
        """This rank's micro-batches per optimizer step."""
        return self.schedule.accumulation_steps

    @property
    def finished(self) -> bool:
        """True once the last step of `steps(total)` is done (and saved)."""
        return self._total is not None and self.state.step >= self._total and not self.stopped

    def steps(self, total: int) -> Iterator[int]:
        """The steps still to train, from the one after the resumed checkpoint to `total`; the work
        between two steps (heartbeat, saves, requests) happens when the loop asks for the next one."""
        if self._total is not None:
            raise RuntimeError("Session.steps() is called once per session")
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a number of steps >= 0, not {total!r}")
        self._total = total
        return self._steps(total)

    def micro_batches(self) -> Iterator[Any]:
        """This rank's micro-batches of the current step, in accumulation order, each with torch's
        global generators seeded for it and gradient synchronisation on the last one only."""
        step = self._current
        if step is None:
            raise RuntimeError("Session.micro_batches() belongs in the body of a step of Session.steps()")
        micro = self.schedule.rank_micro_batches(step)
        last = len(micro) - 1
        for i, mb in enumerate(micro):
            batch = next(self._batches) if self._batches is not None else mb
            self.micro_batch = mb
            torch.manual_seed(rng.micro_batch_seed(self.seed, step, mb.first_position))
            if last and i in (0, last):
                self._own_work.mark(i == last, (last + 1) / last)
            with self._grad_sync(i == last):
                yield batch

    def clip_and_step(self, max_norm: float | None, loss: Any) -> StepCheck:
        """The step's update: clip the gradients to `max_norm` (None: measure their norm only),
        check loss and norm, step the optimizer and the scheduler unless refused, zero the
        gradients; the step's heartbeat carries its loss, norm and `step_skipped` when refused.
        `loss`: this rank's loss of the step (mean over its micro-batches), ideally a tensor not
        yet copied to the host (`ftsup.trainer.stepguard`). Every rank, once per step."""
        return self._checked(self.state.clip_and_step(max_norm, loss))

    def step_guard(self, loss: Any, grad_norm: Any = None) -> StepCheck:
        """Check the step before the loop's own `optimizer.step()`: after backward and clipping
        (`grad_norm`: what `clip_grad_norm_` returned). Refused (loss or norm not finite), the
        gradients are dropped, so the optimizer step that follows changes nothing, and the
        scheduler is put back after the step. Its figures ride on the step's heartbeat. Every
        rank, once per step."""
        return self._checked(self.state.step_guard(loss, grad_norm))

    def _checked(self, check: StepCheck) -> StepCheck:
        self._figures.update(check.figures())
        return check

    def report(self, **figures: Any) -> None:
        """Figures (`loss=...`) for this step's heartbeat. A tensor on a CUDA device is copied without
        waiting and travels with the first heartbeat after it reached the host."""
        for name, value in figures.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                host = value.detach().reshape(()).to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._deferred.append((name, host, event))
            else:
                self._figures[name] = value

    def phase(self, name: str, *, timeout_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        """`with session.phase("eval"):` around work without optimizer steps: heartbeats from a
        thread, for at most `timeout_s` (see `RuntimeClient.phase`)."""
        return self.runtime.phase(name, self.state.step, timeout_s=timeout_s)

    def keepalive(self) -> None:
        """One heartbeat in phase `eval`: call it more often than the heartbeat timeout (at least
        heartbeat.min_timeout_s) inside a long pause; the next step's heartbeat returns to `train`."""
        self.runtime.beat(self.state.step, "eval")

    def close(self) -> None:
        """Finish the saves in flight and close the engine; every rank, after a loop left early
        (a loop that ran to its end or was stopped has closed already)."""
        if self._closed:
            return
        self._closed = True
        self._batches = None
        self._agreement.close()
        with self.runtime.phase("save"):
            self.engine.close()
        self.runtime.beat(self.state.step, "done")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()

    # ------------------------------------------------------------------ between steps

    def _steps(self, total: int) -> Iterator[int]:
        if self.dataset is not None:
            self._batches = iter(self._loader(total))
        step = self.state.step
        started = time.monotonic()
        try:
            while step < total and not self.stopped and not self._closed:
                step += 1
                self._current = step
                yield step
                self._current = None
                took = time.monotonic() - started
                self._between(step, total, took)
                started = time.monotonic()
        finally:
            self._current = None
        if not self._closed:  # resumed at or past the end: nothing to train
            self.close()

    def _between(self, step: int, total: int, took: float) -> None:
        st, rt = self.state, self.runtime
        st.guard.settle()  # a refused step's scheduler step is undone before anything sees it
        st.step, st.samples = step, self.schedule.position_after(step)
        rt.beat(step, "train", **{"step_s": took, "samples": st.samples, **self._take_figures()})
        last = step == total
        if self.save_every is not None and step % self.save_every == 0 and not last:
            with rt.phase("save", step):  # the copy blocks this rank; the write goes on in the background
                st.save(self.engine)
        request = self._agreement.wait()
        serve = request.seq > self._handled
        if serve:
            self._handled = request.seq
            if not last:  # the final save serves it
                self._emergency_save(step, request)
            self.stopped = request.stop and not last
        if last:
            try:
                with rt.phase("save", step):
                    result = st.save(self.engine, kind="final", block=True)
            except CheckpointSaveError:
                if serve:  # it served the supervisor's request too
                    rt.beat(step, "train", **{SAVE_FAILED_STEP: step})
                raise
            if serve:
                rt.beat(step, "train", saved_step=step, save_s=getattr(result, "durable_s", 0.0))
        if last or self.stopped:
            self.close()
        else:
            self._agreement.start(rt.control.poll())

    def _emergency_save(self, step: int, request: Request) -> None:
        rt = self.runtime
        try:
            with rt.phase("save", step):
                result = self.state.save(self.engine, kind="emergency", block=True)
        except CheckpointSaveError as e:
            rt.beat(step, "train", **{SAVE_FAILED_STEP: step})  # the supervisor tells the steps lost
            if self.rank == 0:
                log.error("emergency_save_failed", step=step, stop=request.stop, reason=str(e))
            if request.stop:  # the resume point is the last committed checkpoint; say so by failing
                self.close()
                self.stopped = True
                raise
            return
        where = FALLBACK_STEP if getattr(result, "fallback", False) else SAVED_STEP
        rt.beat(step, "train", **{where: step, "save_s": getattr(result, "durable_s", 0.0)})

    def _take_figures(self) -> dict[str, Any]:
        figures, self._figures = self._figures, {}
        waiting = []
        for name, host, event in self._deferred:
            if event.query():
                figures.setdefault(name, host)
            else:
                waiting.append((name, host, event))
        self._deferred = waiting
        own = self._own_work.take()
        if own is not None:
            figures.setdefault("compute_s", own)
        return figures

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _schedule(
        dataset: Any, global_batch: int | None, micro_batch: int | None, schedule: GlobalBatchSchedule | None,
        seed: int | None,
    ) -> GlobalBatchSchedule:  # fmt: skip
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if schedule is not None:
            if global_batch is not None or micro_batch is not None:
                raise DataConfigError("give a schedule or global_batch and micro_batch, not both")
            if (schedule.rank, schedule.world_size) != (rank, world):
                raise DataConfigError(f"the schedule is for rank {schedule.rank} of {schedule.world_size}, "
                                      f"this process is rank {rank} of {world}")  # fmt: skip
            if seed is not None and seed != schedule.seed:
                raise DataConfigError(f"seed {seed} differs from the schedule's seed {schedule.seed}")
            return schedule
        if dataset is None or global_batch is None or micro_batch is None:
            raise DataConfigError("Session needs a dataset with global_batch and micro_batch, or a schedule")
        return GlobalBatchSchedule(len(dataset), global_batch, micro_batch, world, rank, 0 if seed is None else seed)

    def _loader(self, total: int) -> torch.utils.data.DataLoader[Any]:
        start = self.state.step
        generator = torch.Generator().manual_seed(rng.derive_seed(self.seed, "loader", self.rank, start))
        sampler = RankBatchSampler(self.schedule, start, total)
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, generator=generator,
                                           **self._loader_options)  # fmt: skip

    def _grad_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        model = self.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext() if sync else model.no_sync()
        set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
        if callable(set_sync):
            set_sync(sync)
        return contextlib.nullcontext()


class _OwnWork:
    """The `compute_s` figure: this rank's own work in a step, without waiting for its peers.

    In a job whose ranks synchronise every step, each rank's step lasts as long as the slowest
    rank's (the others wait for it in the gradient all-reduce), so `step_s` is the same on every
    rank and cannot tell which one is slow. The micro-batches before the last one synchronise
    nothing (`no_sync`): their time, scaled to the whole step, is this rank's own. Measured on the
    host's clock, or with CUDA events on a CUDA model (read once they have completed: no
    synchronisation); none with a single micro-batch per step."""

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self._start: Any = None
        self._done: list[tuple[Any, Any, float]] = []

    def mark(self, end: bool, scale: float) -> None:
        now: Any = time.monotonic()
        if self._cuda:
            now = torch.cuda.Event(enable_timing=True)
            now.record()
        if not end:
            self._start = now
        elif self._start is not None:
            self._done = [*self._done[-3:], (self._start, now, scale)]  # a few steps' events at most
            self._start = None

    def take(self) -> float | None:
        """The newest step's figure whose time is known, or None."""
        while self._done:
            start, end, scale = self._done[-1]
            if not self._cuda:
                self._done = []
                return (end - start) * scale
            if not end.query():
                return None
            self._done = []
            return start.elapsed_time(end) / 1000 * scale
        return None
