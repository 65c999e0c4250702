"""The savers the GPU rows compare, behind one call each: ftsup's engine, DCP's `async_save` with pinned-memory staging
(the installed torch's options, recorded) and `torch.save`; `save(sd, step)` returns (a wait for durability, the wait
the next optimizer step must make or None)."""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ftsup.store import layout
from ftsup.store.retention import RetentionPolicy
from ftsup.trainer.checkpoint import CheckpointEngine

Waits = tuple[Callable[[], Any], Callable[[], Any] | None]


class Ftsup:
    """ftsup's engine, one process (no group), new files at every save (no recycling; each save's directory is
    removed by the benchmark before the next but one)."""

    name = "ftsup_async"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.engine = CheckpointEngine(
            directory, process_group=None, retention=RetentionPolicy(keep_last=2), recycle=False, durable_tier=None
        )

    def save(self, sd: dict[str, Any], step: int) -> Waits:
        handle = self.engine.save(step, sd)
        return handle.wait, None  # type: ignore[union-attr]

    def path(self, step: int) -> Path:
        return self.directory / layout.step_dirname(step)

    def load(self, sd: dict[str, Any], step: int) -> None:
        with CheckpointEngine(self.directory, process_group=None, durable_tier=None) as engine:
            engine.load(sd, step=step)

    def close(self) -> None:
        self.engine.close()


def dcp_staging(cuda: bool) -> tuple[dict[str, Any], str, Callable[[], None]]:
    """The keyword arguments that give `dcp.async_save` pinned-memory staging in the installed torch, what they are
    in words, and how to release them."""
    params = inspect.signature(dcp.async_save).parameters
    try:
        from torch.distributed.checkpoint import staging
    except ImportError:
        staging = None  # type: ignore[assignment]
    if "async_stager" in params and hasattr(staging, "DefaultStager") and hasattr(staging, "StagingOptions"):
        DefaultStager, StagingOptions = staging.DefaultStager, staging.StagingOptions  # noqa: N806
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda
        )
        stager = DefaultStager(options)
        words = (
            f"torch {torch.__version__}: async_save(async_stager=DefaultStager(StagingOptions("
            f"use_pinned_memory={cuda}, use_shared_memory=False, use_async_staging={cuda}, "
            f"use_non_blocking_copy={cuda}))), thread executor"
        )
        return {"async_stager": stager}, words, stager.close
    return {}, f"torch {torch.__version__}: async_save with its default staging (no pinned-memory stager)", lambda: None


class DcpAsync:
    """`dcp.async_save` in its thread mode with pinned-memory staging; the next optimizer step waits for its
    staging (`staging_completion`), as torchtitan's loop does."""

    name = "dcp_async"

    def __init__(self, directory: Path, cuda: bool) -> None:
        self.directory = directory
        self.kwargs, self.words, self._close = dcp_staging(cuda)
        if "no_dist" in inspect.signature(dcp.async_save).parameters:
            self.kwargs["no_dist"] = True

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step}"

    def save(self, sd: dict[str, Any], step: int) -> Waits:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        ret = dcp.async_save(sd, checkpoint_id=str(self.path(step)), **self.kwargs)
        if isinstance(ret, AsyncSaveResponse):
            return ret.upload_completion.result, ret.staging_completion.result
        return ret.result, None

    def load(self, sd: dict[str, Any], step: int) -> None:
        extra = {"no_dist": True} if "no_dist" in inspect.signature(dcp.load).parameters else {}
        dcp.load(sd, checkpoint_id=str(self.path(step)), **extra)

    def close(self) -> None:
        self._close()


class TorchSave:
    """`torch.save` of the state dict to one file, fsynced: all of it blocks."""

    name = "torch_save"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step}.pt"

    def save(self, sd: dict[str, Any], step: int) -> Waits:
        path = self.path(step)
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        return (lambda: None), None

    def close(self) -> None:
        pass


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
