"""World-size-independent data order and position.

The job sees one deterministic *global* order of samples: epoch e is a permutation of the
dataset seeded from (seed, e), and global position p is sample `perm_{p // N}[p % N]`. The
data position is one number, the count of global samples consumed by completed optimizer
steps; it means the same thing on any world size.

Optimizer step k (1-based) consumes global positions [(k-1)·G, k·G). That global batch is cut
into G/B micro-batches of B samples in order, and micro-batch j goes to rank j mod W. Each rank
accumulates gradients over its G/(B·W) micro-batches; the global batch and the sequence of
global batches are therefore the same on every world size, and only the summation order of
the gradient differs.

Why not torchdata's StatefulDataLoader alone: its state is the per-rank iterator position,
which means nothing on another world size, and it counts what the loader yielded (prefetched),
not what training consumed. Here the position lives in the training state and the loader is
rebuilt from it, so any DataLoader (num_workers > 0 included) resumes exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ftsup.store.errors import CheckpointError
from ftsup.trainer.rng import derive_seed


class DataConfigError(ValueError):
    """The global batch cannot be split over this world size (or another impossible config)."""


class DataPositionError(CheckpointError):
    """A saved data position is missing, malformed, or inconsistent with the saved step."""


@dataclass(frozen=True)
class MicroBatch:
    step: int  # the optimizer step (1-based) this micro-batch belongs to
    index: int  # j: its index within the global batch
    first_position: int  # global position of its first sample
    sample_ids: tuple[int, ...]


@dataclass(frozen=True)
class GlobalBatchSchedule:
    dataset_size: int
    global_batch: int
    micro_batch: int
    world_size: int
    rank: int
    seed: int
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dataset_size", "global_batch", "micro_batch", "world_size"):
            if getattr(self, name) < 1:
                raise DataConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise DataConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        per_step = self.micro_batch * self.world_size
        if self.global_batch % per_step:
            raise DataConfigError(
                f"global batch {self.global_batch} cannot be split into micro-batches of {self.micro_batch} "
                f"over {self.world_size} ranks: it is not a multiple of {self.micro_batch} x {self.world_size} "
                f"= {per_step}. Keep the global batch (it defines the run) and choose a world size or micro "
                f"batch that divides it"
            )

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.world_size)

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch // self.micro_batch

    def _perm(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
            perm = torch.randperm(self.dataset_size, generator=g)
            self._perms.clear()  # keep one epoch: memory stays O(dataset)
            self._perms[epoch] = perm
        return perm

    def sample_ids(self, start: int, count: int) -> tuple[int, ...]:
        out = []
        for p in range(start, start + count):
            out.append(int(self._perm(p // self.dataset_size)[p % self.dataset_size]))
        return tuple(out)

    def rank_micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of optimizer step `step` (1-based), in accumulation order."""
        base = (step - 1) * self.global_batch
        out = []
        for j in range(self.rank, self.micro_batches_per_step, self.world_size):
            first = base + j * self.micro_batch
            out.append(MicroBatch(step, j, first, self.sample_ids(first, self.micro_batch)))
        return out

    def position_after(self, step: int) -> int:
        return step * self.global_batch

    def check_position(self, step: int, samples: Any) -> None:
        """Refuse a data position that does not belong to `step` (never restart from zero)."""
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
            raise DataPositionError(f"saved data position {samples!r} is not a non-negative integer sample count")
        if samples != self.position_after(step):
            raise DataPositionError(
                f"saved data position {samples} samples does not match step {step} x global batch "
                f"{self.global_batch} = {self.position_after(step)}; the checkpoint's data position is "
                "corrupt or from a run with another global batch"
            )


class RankBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices) from step `start_step` + 1 on.

    Give it to `DataLoader(dataset, batch_sampler=...)`. It is rebuilt from the saved position
    on resume, so prefetching workers never move the position.
    """

    def __init__(self, schedule: GlobalBatchSchedule, start_step: int, end_step: int):
        self.schedule = schedule
        self.start_step = start_step
        self.end_step = end_step

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step + 1, self.end_step + 1):
            for mb in self.schedule.rank_micro_batches(step):
                yield list(mb.sample_ids)

    def __len__(self) -> int:
        return max(0, self.end_step - self.start_step) * self.schedule.accumulation_steps
