"""Session: the bookkeeping of a training loop that resumes exactly, in one object: resume, batches, random streams,
heartbeats, saves and the supervisor's requests.

What each call does: docs/adopting.md; how and why: docs/design/trainer.md, The Session.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

import structlog
import torch
import torch.distributed as dist

from ftsup.protocol import FALLBACK_STEP, SAVE_FAILED_STEP, SAVED_STEP, Request
from ftsup.store.errors import CheckpointSaveError
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer import rng
from ftsup.trainer.batches import CallableSource, IterableSource, Streams, batch_source
from ftsup.trainer.checkpoint.engine import CheckpointEngine, LoadResult
from ftsup.trainer.data import DataConfigError, GlobalBatchSchedule, MicroBatch, RankBatchSampler
from ftsup.trainer.dcp.load import DcpInit
from ftsup.trainer.hf.load import HfInit
from ftsup.trainer.ownwork import OwnWork
from ftsup.trainer.runtime import Agreement, RuntimeClient, runtime
from ftsup.trainer.state import TrainingState
from ftsup.trainer.stepguard import StepCheck
from ftsup.workdir import default_checkpoint_dir, ignore_for_git

log = structlog.get_logger("ftsup.trainer")

DEFAULT_SAVE_EVERY = 100
P = ParamSpec("P")
T = TypeVar("T")
Init = TypeVar("Init", HfInit, DcpInit)


class Session:
    """A training loop's bookkeeping: resume, batches, random streams, heartbeats, saves, the supervisor's requests.

    Where the batches come from, one of: a map-style `dataset` with `global_batch` and `micro_batch` (or a
    `schedule`; then `dataset` is optional and `micro_batches()` yields `MicroBatch` descriptions), served in an
    order that does not depend on the world size; `batches=` a callable (one call per micro-batch) or an iterable
    (a DataLoader, an `IterableDataset`, an iterator: one item per micro-batch), with `accumulation_steps` of them
    per step; or nothing, for a loop that draws its own batches (`fetcher` for one that fetches ahead). Every rank's
    random streams travel with each checkpoint and are put back on resume. `collate_fn`, `num_workers` and
    `pin_memory` go to a dataset's DataLoader. `engine`: a CheckpointEngine of your own (then `ckpt_dir` and
    `keep_last` are not used); `ckpt_dir`: default `FTSUP_CHECKPOINT_DIR`, else `./.ftsup/checkpoints`.
    `save_every`: steps between periodic saves (None: only emergency and final ones). `seed` (default 0, or the
    schedule's): a dataset's order and dropout seeds, and the streams of a rank a checkpoint does not have. `skip`:
    ranges (A, B) of a dataset's global positions never to serve (with `FTSUP_DATA_SKIPS` and the checkpoint's).
    `init_from_hf`: a Hugging Face Hub-layout model directory whose weights a fresh run starts from; `init_from_dcp`:
    a DCP checkpoint directory (torch's or torchtitan's, or one of its `step-N` folders) the same way.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        dataset: Any = None,
        *,
        batches: Any = None,
        accumulation_steps: int | None = None,
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
        init_from_dcp: str | os.PathLike[str] | None = None,
    ) -> None:
        if init_from_hf is not None and init_from_dcp is not None:
            raise ValueError("init_from_hf and init_from_dcp: a run starts from one model's weights, not two")
        if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every must be a number of steps >= 1 or None, not {save_every!r}")
        skip = tuple(skip)
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.schedule = _schedule(dataset, batches, global_batch, micro_batch, schedule, seed, accumulation_steps, skip)
        self._source: CallableSource | IterableSource | None = None if batches is None else batch_source(batches)
        self._accumulation = _count_of("accumulation_steps", accumulation_steps)
        self.runtime: RuntimeClient = runtime()
        rt = self.runtime
        rt.beat(rt.env.resume_step or 0, "init")
        self.model = model
        self.dataset = dataset
        self.save_every = save_every
        if self.schedule is not None:
            self.schedule = self.schedule.with_skips(skip)
        self.seed = self.schedule.seed if self.schedule is not None else (seed or 0)
        self._loader_options = {"collate_fn": collate_fn, "num_workers": num_workers, "pin_memory": pin_memory}
        self._streams = Streams()
        if engine is None:
            engine = CheckpointEngine(self._directory(ckpt_dir), retention=RetentionPolicy(keep_last=keep_last))
        self.engine = engine
        try:
            st = TrainingState(
                model, optimizer, scheduler, scaler, schedule=self.schedule, config=config, seed=self.seed
            )
            self.state = st
            st.streams = self._streams.capture
            if self._source is not None:
                st.batch_source, st.source_position = self._source.kind, self._source.position
            with rt.phase("load"):
                self.loaded: LoadResult | None = st.resume(engine, at_most=rt.env.resume_bound, restore_streams=False)
                self.hf_init: HfInit | None = None
                """What `init_from_hf` loaded (None: a checkpoint was resumed, or no Hugging Face model was given)."""
                if self.loaded is None and init_from_hf is not None:
                    self.hf_init = _init_from("hf_model_loaded", self.rank, st.init_from_hf, init_from_hf)
                self.dcp_init: DcpInit | None = None
                """What `init_from_dcp` loaded (None: a checkpoint was resumed, or no DCP checkpoint was given)."""
                if self.loaded is None and init_from_dcp is not None:
                    self.dcp_init = _init_from("dcp_model_loaded", self.rank, st.init_from_dcp, init_from_dcp)
            if self.loaded is not None:
                self._streams.pending(functools.partial(self._resume_position, self.loaded))
            self.schedule = st.schedule  # with every skip in force
            self._agreement = Agreement()
        except BaseException:
            engine.close()  # its writer thread is ours; nothing was saved
            raise
        self.micro_batch: MicroBatch | None = None
        """The micro-batch of a dataset that `micro_batches()` yielded last (its step, index and sample ids)."""
        self.stopped = False
        """True once the loop ended because the supervisor asked the job to stop."""
        self._total: int | None = None
        self._current: int | None = None  # the optimizer step (1-based) whose body runs now
        self._batches: Iterator[Any] | None = None
        self._handled = 0  # the newest request seq served
        self._figures: dict[str, Any] = {}
        self._deferred: list[tuple[str, torch.Tensor, Any]] = []  # figures still on their way from a device
        self._own_work = OwnWork(any(p.is_cuda for p in model.parameters()))
        self._closed = False

    def _directory(self, ckpt_dir: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
        if ckpt_dir is not None:
            return ckpt_dir
        if self.runtime.env.checkpoint_dir:
            return self.runtime.env.checkpoint_dir
        directory = default_checkpoint_dir(os.getcwd())
        directory.mkdir(parents=True, exist_ok=True)
        ignore_for_git(directory.parent)
        if self.rank == 0:
            log.info("checkpoint_dir_defaulted", path=str(directory), reason="no ckpt_dir= and no FTSUP_CHECKPOINT_DIR")
        return directory

    # ------------------------------------------------------------------ what the loop uses

    @property
    def step(self) -> int:
        """Optimizer steps completed (and saved in the state)."""
        return self.state.step

    @property
    def accumulation_steps(self) -> int:
        """This rank's micro-batches per optimizer step."""
        return self.schedule.accumulation_steps if self.schedule is not None else self._accumulation

    @property
    def finished(self) -> bool:
        """True once the last step of `steps(total)` is done (and saved)."""
        return self._total is not None and self.state.step >= self._total and not self.stopped

    def steps(self, total: int, *, first: int = 1) -> Iterator[int]:
        """The numbers of the steps still to train of `total` optimizer steps numbered from `first` (1: 1..total;
        0: 0..total-1, as `range(total)` numbers them), from the one after the resumed checkpoint's on; the work
        between two steps (heartbeat, saves, requests) happens when the loop asks for the next one."""
        if self._total is not None:
            raise RuntimeError("Session.steps() is called once per session")
        if not isinstance(total, int) or total < 0:
            raise ValueError(f"total must be a number of steps >= 0, not {total!r}")
        if not isinstance(first, int):
            raise ValueError(f"first must be the number of the first step (an int), not {first!r}")
        self._total = total
        return self._steps(total, first)

    def micro_batches(self) -> Iterator[Any]:
        """This rank's micro-batches of the current step, in accumulation order, with gradient synchronisation on
        the last one only; a dataset's with torch's global generators seeded for each."""
        step = self._current
        if step is None:
            raise RuntimeError("Session.micro_batches() belongs in the body of a step of Session.steps()")
        items: Iterator[tuple[MicroBatch | None, Any]]
        if self.schedule is not None:
            micro = self.schedule.rank_micro_batches(step)
            count = len(micro)
            items = ((mb, next(self._batches) if self._batches is not None else mb) for mb in micro)
        elif self._source is not None:
            count, source = self._accumulation, self._source
            items = ((None, source.next()) for _ in range(count))
        else:
            raise RuntimeError(
                "Session.micro_batches() needs batches= or a dataset; without either the loop draws its own"
            )
        last = count - 1
        for i, (mb, batch) in enumerate(items):
            self.micro_batch = mb
            if mb is not None:
                torch.manual_seed(rng.micro_batch_seed(self.seed, step, mb.first_position))
            if last and i in (0, last):
                self._own_work.mark(i == last, (last + 1) / last)
            with self._grad_sync(i == last):
                yield batch

    def fetcher(self, fetch: Callable[P, T]) -> Callable[P, T]:
        """`get_batch = session.fetcher(get_batch)`, for a loop that fetches its batches ahead (its first before the
        loop, each next one inside the step before): the calls before the first step tell how far ahead it is, and
        each checkpoint holds the random streams as they were before that many fetches, which the resumed loop's
        own fetches before its first step draw again (`ftsup.trainer.batches.Streams`)."""
        streams = self._streams

        @functools.wraps(fetch)
        def fetched(*args: P.args, **kwargs: P.kwargs) -> T:
            streams.fetching()
            return fetch(*args, **kwargs)

        return fetched

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

    @contextlib.contextmanager
    def phase(self, name: str, *, timeout_s: float | None = None) -> Iterator[None]:
        """`with session.phase("eval"):` (or `@session.phase("eval")` on a function) around work without optimizer
        steps, on any ranks: heartbeats from a thread, for at most `timeout_s` (see `RuntimeClient.phase`)."""
        with self.runtime.phase(name, self.state.step, timeout_s=timeout_s):
            yield

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

    def _steps(self, total: int, first: int) -> Iterator[int]:
        if self.dataset is not None and self.schedule is not None:
            self._batches = iter(self._loader(self.schedule, total))
        step = self.state.step
        if step < total:
            self._streams.started()
        started = time.monotonic()
        try:
            while step < total and not self.stopped and not self._closed:
                step += 1
                self._current = step
                yield step - 1 + first
                self._current = None
                took = time.monotonic() - started
                self._between(step, total, took)
                started = time.monotonic()
        finally:
            self._current = None
        if not self._closed:  # resumed at or past the end: nothing to train
            self.close()

    def _resume_position(self, loaded: LoadResult) -> None:
        """The resumed rank's batch source position, then its random streams (at its first fetch or step)."""
        saved = loaded.rank_state if isinstance(loaded.rank_state, Mapping) else {}
        with self.runtime.phase("load", self.state.step):
            if self._source is not None and isinstance(saved.get("source"), Mapping):
                self._source.resume(saved["source"])
            self.state.restore_streams(loaded)

    def _between(self, step: int, total: int, took: float) -> None:
        st, rt = self.state, self.runtime
        st.guard.settle()  # a refused step's scheduler step is undone before anything sees it
        st.step = step
        figures: dict[str, Any] = {"step_s": took}
        if self.schedule is not None:
            st.samples = figures["samples"] = self.schedule.position_after(step)
        rt.beat(step, "train", **(figures | self._take_figures()))
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

    def _loader(self, schedule: GlobalBatchSchedule, total: int) -> torch.utils.data.DataLoader[Any]:
        start = self.state.step
        generator = torch.Generator().manual_seed(rng.derive_seed(self.seed, "loader", self.rank, start))
        sampler = RankBatchSampler(schedule, start, total)
        options = self._loader_options
        return torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, generator=generator, **options)

    def _grad_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        model = self.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext() if sync else model.no_sync()
        set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
        if callable(set_sync):
            set_sync(sync)
        return contextlib.nullcontext()


def _schedule(
    dataset: Any,
    batches: Any,
    global_batch: int | None,
    micro_batch: int | None,
    schedule: GlobalBatchSchedule | None,
    seed: int | None,
    accumulation_steps: int | None,
    skip: tuple[tuple[int, int], ...],
) -> GlobalBatchSchedule | None:
    """A dataset's schedule, or None for a batch source or a loop that draws its own batches."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sized = dataset is not None or schedule is not None or global_batch is not None or micro_batch is not None
    if batches is not None and sized:
        raise DataConfigError(
            "batches= is the loop's own source of micro-batches: give it without a dataset, a schedule, global_batch "
            "or micro_batch"
        )
    if accumulation_steps is not None and batches is None:
        raise DataConfigError("accumulation_steps= is how many items of batches= make a step: give it with batches=")
    if not sized:
        if skip:
            raise DataConfigError("skip= needs a map-style dataset: a batch source has no global data positions")
        return None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise DataConfigError("an IterableDataset has no global order: give it (or its DataLoader) as batches=")
    if schedule is not None:
        if global_batch is not None or micro_batch is not None:
            raise DataConfigError("give a schedule or global_batch and micro_batch, not both")
        if (schedule.rank, schedule.world_size) != (rank, world):
            raise DataConfigError(
                f"the schedule is for rank {schedule.rank} of {schedule.world_size}, this process is rank {rank} of "
                f"{world}"
            )
        if seed is not None and seed != schedule.seed:
            raise DataConfigError(f"seed {seed} differs from the schedule's seed {schedule.seed}")
        return schedule
    if dataset is None or global_batch is None or micro_batch is None:
        raise DataConfigError("Session needs a dataset with global_batch and micro_batch, or a schedule")
    return GlobalBatchSchedule(len(dataset), global_batch, micro_batch, world, rank, 0 if seed is None else seed)


def _count_of(name: str, value: int | None) -> int:
    if value is None:
        return 1
    if type(value) is not int or value < 1:
        raise DataConfigError(f"{name} must be a number >= 1, not {value!r}")
    return value


def _init_from(event: str, rank: int, load: Callable[[Any], Init], source: Any) -> Init:
    """`load(source)`: a fresh start's weights from outside the store, logged as `event` with where they came from,
    what was read and how long it took."""
    t0 = time.monotonic()
    got = load(source)
    took = round(time.monotonic() - t0, 4)
    fields: dict[str, Any] = {"rank": rank, "path": got.origin["dir"], "bytes_read": got.bytes_read}
    if isinstance(got, DcpInit):
        fields["structure_bytes_read"] = got.structure_bytes_read
    log.info(event, **fields, duration_s=took)
    return got
