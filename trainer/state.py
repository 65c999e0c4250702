"""`TrainingState`: everything a run needs to continue exactly where it stopped, as one `Stateful`: model, optimizer,
scheduler, scaler, step, data position and skips, the recorded configuration, the step guard; each rank's random
streams and batch source position travel as its `rank_state`.

docs/adopting.md shows it in a loop; docs/design/trainer.md, The training state and its configuration.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ftsup.protocol import check_data_skips
from ftsup.store.errors import CheckpointMismatchError, NoCheckpointError
from ftsup.trainer import modelconfig, rng
from ftsup.trainer.checkpoint.engine import CheckpointEngine, LoadResult, SaveHandle, SaveResult
from ftsup.trainer.data import DataPositionError, GlobalBatchSchedule
from ftsup.trainer.dcp.load import DcpInit, load_dcp_model
from ftsup.trainer.hf.load import HfInit, load_hf_model
from ftsup.trainer.runtime import runtime
from ftsup.trainer.stepguard import StepCheck, StepGuard

log = structlog.get_logger("ftsup.trainer")


class TrainingState:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        *,
        schedule: GlobalBatchSchedule | None = None,
        config: Any = None,
        seed: int | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.seed = schedule.seed if schedule is not None else (seed or 0)
        """The seed of the streams a rank gets when the checkpoint has none of its own (`rng.reseed`)."""
        skips = runtime().env.data_skips
        if schedule is None and skips and self.rank == 0:  # the supervisor asked for what this run cannot do
            log.warning("data_skips_not_applied", reason="the run serves no global data order (no map-style dataset)")
        self._base_schedule = schedule.with_skips(skips) if schedule is not None else None
        self.schedule = self._base_schedule
        """The schedule in force: the given one with the environment's and the resumed checkpoint's skips; None for a
        run whose batches come from a source of its own (no global data positions)."""
        self.streams: Callable[[], Any] = rng.capture
        """This rank's random streams as a save records them (`rank_state["rng"]`)."""
        self.source_position: Callable[[], Any] | None = None
        """This rank's batch source position as a save records it (`rank_state["source"]`), or None."""
        self.batch_source: str | None = None
        """The kind of batch source the run draws from (`callable`, `iterable`; None: a dataset or the loop's own),
        recorded in the metadata and compared on resume."""
        self.config = modelconfig.canonical(config)  # ConfigError now, not at the first save
        self.guard = StepGuard(optimizer, scheduler, scaler)
        self.step = 0
        self.samples = 0
        self.origin: dict[str, Any] | None = None
        """Where the run's first weights came from (`ftsup.trainer.hf.load`: a Hugging Face model), recorded in
        every checkpoint's metadata (`init_from_hf`) and taken back up by a resume; None: its own initialisation."""
        self.dcp_origin: dict[str, Any] | None = None
        """The same for a DCP checkpoint's weights (`ftsup.trainer.dcp.load`), recorded as `init_from_dcp`."""

    def init_from_hf(
        self,
        directory: str | os.PathLike[str],
        *,
        rename: Mapping[str, str] | Callable[[str], str] | None = None,
        convert: bool = False,
        group: Any = None,
    ) -> HfInit:
        """The model's weights from a Hugging Face Hub-layout model directory (`ftsup.trainer.hf.load.load_hf_model`,
        collective: each rank reads its share), recorded as the run's `origin` in every checkpoint from now on."""
        result = load_hf_model(self.model, directory, rename=rename, convert=convert, group=group)
        self.origin = result.origin
        return result

    def init_from_dcp(
        self,
        directory: str | os.PathLike[str],
        *,
        step: int | None = None,
        prefix: str | None = None,
        group: Any = None,
    ) -> DcpInit:
        """The model's weights from a DCP checkpoint directory (torchtitan's `step-N` folders included:
        `ftsup.trainer.dcp.load.load_dcp_model`, collective: each rank reads its share), recorded as the run's
        `init_from_dcp` in every checkpoint from now on."""
        result = load_dcp_model(self.model, directory, step=step, prefix=prefix, group=group)
        self.dcp_origin = result.origin
        return result

    # ------------------------------------------------------------------ the step guard

    def step_guard(self, loss: Any, grad_norm: Any = None) -> StepCheck:
        """`StepGuard.check`: after backward (and clipping), before `optimizer.step()`."""
        return self.guard.check(loss, grad_norm)

    def clip_and_step(self, max_norm: float | None, loss: Any) -> StepCheck:
        """`StepGuard.clip_and_step` over the model's parameters."""
        return self.guard.clip_and_step(self.model.parameters(), max_norm, loss)

    # ------------------------------------------------------------------ Stateful

    def state_dict(self) -> dict[str, Any]:
        self.guard.settle()  # a refused step's scheduler step is not saved
        fresh = not self.optimizer.state
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if fresh:  # torch made a state up with a step of zero gradients; the loop's first step must stay its first
            self.optimizer.state.clear()
        sd: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "progress": {"step": self.step, "samples": self.samples},
        }
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        progress = sd.get("progress")
        if not isinstance(progress, Mapping) or not isinstance(progress.get("step"), int):
            raise DataPositionError(f"checkpoint progress entry is missing or malformed: {progress!r:.200}")
        if self.schedule is not None:
            self.schedule.check_position(progress["step"], progress.get("samples"))
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if (obj is None) != (name not in sd):
                have = "has" if name in sd else "has no"
                raise CheckpointMismatchError(
                    f"the checkpoint {have} {name} state but this run {'has' if obj else 'has no'} {name}",
                    keys=[name],
                )
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])
        self.step = progress["step"]
        self.samples = progress["samples"]

    # ------------------------------------------------------------------ with the engine

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {} if self.origin is None else {"init_from_hf": self.origin}
        if self.dcp_origin is not None:
            meta["init_from_dcp"] = self.dcp_origin
        meta["step"] = self.step
        if self.schedule is not None:
            meta |= {
                "samples": self.samples,
                "global_batch": self.schedule.global_batch,
                "micro_batch": self.schedule.micro_batch,
                "dataset_size": self.schedule.dataset_size,
                "data_seed": self.schedule.seed,
                "data_skips": [list(r) for r in self.schedule.skips],
            }
        if self.batch_source is not None:
            meta["batch_source"] = self.batch_source
        return meta | {"config": self.config, "components": self._components()}

    def rank_state(self) -> dict[str, Any]:
        """What this rank's `rank_state` holds: its random streams and its batch source's position."""
        state = {"rng": self.streams()}
        if self.source_position is not None:
            state["source"] = self.source_position()
        return state

    def _components(self) -> list[str]:
        return [name for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)) if obj is not None]

    def save(self, engine: CheckpointEngine, *, kind: str = "periodic", block: bool = False) -> SaveHandle | SaveResult:
        return engine.save(
            self.step,
            {"train": self},
            kind=kind,
            rank_state=self.rank_state(),
            metadata=self.metadata(),
            block=block,
        )

    def check_metadata(self, meta: Mapping[str, Any]) -> None:
        """Refuse, before any tensor moves, a checkpoint of another model or data configuration."""
        diffs = modelconfig.describe(modelconfig.differences(meta.get("config", {}), self.config))
        schedule = self.schedule
        for key, mine in (
            ("global_batch", schedule.global_batch if schedule is not None else None),
            ("dataset_size", schedule.dataset_size if schedule is not None else None),
            ("data_seed", schedule.seed if schedule is not None else None),
            ("batch_source", self.batch_source),
        ):
            if meta.get(key) != mine:
                diffs.append(f"{key}: checkpoint {meta.get(key)!r} != this run {mine!r}")
        saved_parts = set(meta.get("components", self._components()))
        for name in sorted(saved_parts ^ set(self._components())):
            have = "has" if name in saved_parts else "has no"
            ours = "has no" if name in saved_parts else "has"
            diffs.append(f"{name}: the checkpoint {have} {name} state but this run {ours} {name}")
        if diffs:
            raise CheckpointMismatchError(
                "the checkpoint is from a different configuration: " + "; ".join(diffs),
                keys=[d.split(":")[0] for d in diffs],
            )
        try:
            saved_skips = check_data_skips(meta.get("data_skips", []), "the checkpoint's data_skips")
        except ValueError as e:
            raise DataPositionError(str(e)) from None
        if self._base_schedule is None:
            return
        self.schedule = self._base_schedule.with_skips(saved_skips)  # a skip is never forgotten
        if "step" in meta:
            self.schedule.check_position(meta["step"], meta.get("samples"))

    def resume(
        self,
        engine: CheckpointEngine,
        step: int | None = None,
        *,
        at_most: int | None = None,
        restore_streams: bool = True,
    ) -> LoadResult | None:
        """Load checkpoint `step`, or the latest consistent one (of at most `at_most`, which is how
        the supervisor's choice, `FTSUP_RESUME_STEP`, is passed: a corrupt one is still skipped).

        Returns None (and leaves the fresh state) when there is no checkpoint and no step was asked
        for. When there were checkpoints but none could be used (each was logged, quarantined or
        skipped), that fresh start is logged too: `training_started_from_scratch`, a warning.
        `restore_streams=False` leaves the random streams to a later `restore_streams(result)`.
        """
        try:
            result = engine.load({"train": self}, step=step, at_most=at_most, check=self.check_metadata)
        except BaseException as e:
            self.schedule = self._base_schedule  # none loaded: a candidate refused may have set its skips
            if step is not None or not isinstance(e, NoCheckpointError):
                raise
            if e.rejected and self.rank == 0:
                log.warning("training_started_from_scratch", step=0, unusable=len(e.rejected), reason=str(e))
            return None
        if isinstance(result.metadata.get("init_from_hf"), dict):
            self.origin = dict(result.metadata["init_from_hf"])
        if isinstance(result.metadata.get("init_from_dcp"), dict):
            self.dcp_origin = dict(result.metadata["init_from_dcp"])
        if restore_streams:
            self.restore_streams(result)
        return result

    def restore_streams(self, result: LoadResult) -> None:
        """This rank's random streams as the checkpoint of `result` saved them, or, for a rank it did not have, streams
        derived from (seed, rank, step)."""
        saved = result.rank_state
        if isinstance(saved, Mapping) and "rng" in saved:
            rng.restore(saved["rng"])
        else:  # this rank did not exist when the checkpoint was saved
            rng.reseed(self.seed, self.rank, self.step)
