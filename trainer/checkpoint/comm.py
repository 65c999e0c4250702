"""The few collectives the checkpoint engine needs, on its own gloo group; `LocalComm` for a single process
(trainer/checkpoint/DESIGN.md, "Its own process group").
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftsup.store.errors import CheckpointError


class LocalComm:
    rank = 0
    world_size = 1
    group = None

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None  # single process: rank 0 always provides the list
        return objs[0]

    def all_reduce_max(self, value: int) -> int:
        return value


class GroupComm:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` of group rank `src`, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        box: list[Any] = [None]
        dist.scatter_object_list(box, objs, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_reduce_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())


def make_comm(process_group: Any = "auto", timeout_s: float = 1800.0) -> LocalComm | GroupComm:
    """`"auto"` or None: a new gloo group over all ranks when torch.distributed is initialised
    (a collective call), else a local single-process comm. A given group is used as is.

    None means "auto", never "single process": under torch.distributed every rank would
    otherwise think it is rank 0 of 1 and write the same shard file names into one checkpoint.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return LocalComm()
    if process_group is None or (isinstance(process_group, str) and process_group == "auto"):
        return GroupComm(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    if isinstance(process_group, str):
        raise CheckpointError(f'process_group must be "auto", None or a ProcessGroup, got {process_group!r}')
    return GroupComm(process_group)
