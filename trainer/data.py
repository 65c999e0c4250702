"""World-size-independent data order and position: `GlobalBatchSchedule` (skips included) and `RankBatchSampler`.

How and why: docs/design/trainer.md, The data order.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ftsup.protocol import MAX_DATA_POSITION, MAX_DATA_SKIPS, DataSkips
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
    positions: tuple[int, ...] = ()  # the global position of each sample (consecutive unless a skip lies between)


@dataclass(frozen=True)
class GlobalBatchSchedule:
    dataset_size: int
    global_batch: int
    micro_batch: int
    world_size: int
    rank: int
    seed: int
    skips: DataSkips = ()
    """Ranges [A, B) of global positions never served; any iterable of pairs, kept sorted and merged."""
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "skips", merge_skips(self.skips))
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

    def with_skips(self, skips: Iterable[tuple[int, int]]) -> GlobalBatchSchedule:
        """This schedule with `skips` skipped too (the union with its own)."""
        return dataclasses.replace(self, skips=(*self.skips, *skips))

    def sample_ids(self, start: int, count: int) -> tuple[int, ...]:
        """The sample ids at the `count` global positions from `start` on (skips or not)."""
        return self._ids(range(start, start + count))

    def _ids(self, positions: Iterable[int]) -> tuple[int, ...]:
        n = self.dataset_size
        return tuple(int(self._perm(p // n)[p % n]) for p in positions)

    def _position(self, served: int) -> int:
        """The global position of the `served`-th position served (0-based): past every skip before it."""
        p = served
        for a, b in self.skips:
            if a > p:
                break
            p += b - a
        return p

    def _positions(self, served: int, count: int) -> tuple[int, ...]:
        """The global positions of the `count` positions served from the `served`-th on."""
        p = self._position(served)
        k = bisect.bisect_right(self.skips, (p, MAX_DATA_POSITION + 1))  # the first skip after p
        out: list[int] = []
        while len(out) < count:
            end = self.skips[k][0] if k < len(self.skips) else p + count
            take = min(count - len(out), end - p)
            out.extend(range(p, p + take))
            p += take
            if len(out) < count:  # p is where skip k begins
                p = self.skips[k][1]
                k += 1
        return tuple(out)

    def rank_micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of optimizer step `step` (1-based), in accumulation order."""
        base = (step - 1) * self.global_batch
        out = []
        for j in range(self.rank, self.micro_batches_per_step, self.world_size):
            positions = self._positions(base + j * self.micro_batch, self.micro_batch)
            out.append(MicroBatch(step, j, positions[0], self._ids(positions), positions))
        return out

    def position_after(self, step: int) -> int:
        """The data position after step `step`: one past the last position it served (0 before any)."""
        return self._position(step * self.global_batch - 1) + 1 if step > 0 else 0

    def check_position(self, step: int, samples: Any) -> None:
        """Refuse a data position that does not belong to `step` (never restart from zero)."""
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
            raise DataPositionError(f"saved data position {samples!r} is not a non-negative integer sample count")
        if samples != self.position_after(step):
            skips = f" with the skips {list(map(list, self.skips))}" if self.skips else ""
            raise DataPositionError(
                f"saved data position {samples} samples does not match step {step} x global batch "
                f"{self.global_batch}{skips} = position {self.position_after(step)}; the checkpoint's data "
                "position is corrupt, from a run with another global batch, or a skip in force covers data "
                "that this checkpoint's steps have trained on"
            )


def merge_skips(skips: Iterable[tuple[int, int]]) -> DataSkips:
    """`skips` (pairs of integers 0 <= A < B <= MAX_DATA_POSITION, in any order, overlapping or
    not) sorted and merged; DataConfigError when one is not a range or more than MAX_DATA_SKIPS
    ranges are left."""
    pairs = []
    for item in skips:
        try:
            a, b = item
        except (TypeError, ValueError):
            raise DataConfigError(f"a data skip must be a range (A, B) of two integers, not {item!r:.60}") from None
        if type(a) is not int or type(b) is not int or not 0 <= a < b <= MAX_DATA_POSITION:
            raise DataConfigError(f"a data skip must be integers 0 <= A < B <= {MAX_DATA_POSITION}, not {item!r:.60}")
        pairs.append((a, b))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(pairs):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    if len(merged) > MAX_DATA_SKIPS:
        raise DataConfigError(f"{len(merged)} data skips, more than {MAX_DATA_SKIPS}; merge some of them")
    return tuple(merged)


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
