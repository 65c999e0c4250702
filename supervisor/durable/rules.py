"""The durable tier's decisions: which committed checkpoints go durable, how long an upload is expected to take,
which durable checkpoints retention lets go. Pure functions over values; no I/O, no clock
(docs/design/durable-uploads.md, The rules).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ftsup.store import layout, retention
from ftsup.supervisor.config.durable import DurableConfig

FIRST_BYTES_PER_S = 64 * 2**20
"""The upload throughput assumed before one is measured (64 MiB/s), below what an upload of 16 MiB parts, 8 at once,
reaches to S3 from a cloud VM or to the tests' SeaweedFS on 127.0.0.1 (`ftsup/store/DESIGN.md`, "Durable tier"), so
that the first eviction's estimate errs long."""
MIN_MEASURED_BYTES = 4 * 2**20
"""An upload that sent less than this (everything was already there) measures latency, not throughput."""
RATE_HISTORY = 5


@dataclass(frozen=True)
class Picks:
    """What `pick` has seen: the newest step looked at (None before the first look), periodic ones counted."""

    seen: int | None = None
    periodic: int = 0


def pick(
    cfg: DurableConfig, state: Picks, recent: Iterable[layout.CheckpointInfo]
) -> tuple[Picks, list[layout.CheckpointInfo]]:
    """The checkpoints of `recent` (the fast tier's newest, as a scan that went through found them) that go durable
    now, oldest first."""
    state, chosen, _ = candidates(cfg, state, recent)
    return state, chosen


def candidates(
    cfg: DurableConfig, state: Picks, recent: Iterable[layout.CheckpointInfo]
) -> tuple[Picks, list[layout.CheckpointInfo], list[layout.CheckpointInfo]]:
    """`pick`, and the other new periodic checkpoints (oldest first) where periodic ones go at all: in a job whose
    nodes keep separate fast tiers, a node other than rank 0's uploads those its leader picked
    (`ftsup.store.durable.s3nodes.follows`), whatever its own count says."""
    infos = sorted(recent, key=lambda i: i.step)
    newest = max((i.step for i in infos), default=None)
    if state.seen is None:
        if newest is None:  # an empty store: everything from now on is new
            return Picks(seen=-1, periodic=state.periodic), [], []
        consistent = [i for i in infos if i.consistent]
        first = consistent[-1:] if consistent and cfg.wants(consistent[-1].kind) else []
        return Picks(seen=newest, periodic=state.periodic), first, []
    chosen: list[layout.CheckpointInfo] = []
    others: list[layout.CheckpointInfo] = []
    periodic = state.periodic
    for info in infos:
        if info.step <= state.seen or not info.consistent:
            continue
        if info.kind == "periodic":
            periodic += 1
            if cfg.periodic_every > 0 and periodic % cfg.periodic_every == 0:
                chosen.append(info)
            elif cfg.periodic_every > 0:
                others.append(info)
        elif cfg.wants(info.kind):
            chosen.append(info)
    seen = state.seen if newest is None else max(state.seen, newest)
    return Picks(seen=seen, periodic=periodic), chosen, others


def measured_rate(bytes_sent: int, send_s: float) -> float | None:
    """The throughput one upload measured, or None when it is no measurement (too few bytes, no time)."""
    if bytes_sent < MIN_MEASURED_BYTES or not send_s > 0:
        return None
    return bytes_sent / send_s


def upload_estimate_s(state_bytes: int | None, rates: Sequence[float]) -> float | None:
    """How long uploading a checkpoint of `state_bytes` takes: at the slowest recent measured rate, else at
    FIRST_BYTES_PER_S; None when its size is unknown."""
    if not state_bytes:
        return None
    rate = min(rates[-RATE_HISTORY:]) if rates else FIRST_BYTES_PER_S
    return state_bytes / rate


def victims(
    listed: Iterable[tuple[int, bool]],
    *,
    keep_last: int,
    keep_older_than_steps: int,
    newest: int,
    pinned: Iterable[int] = (),
) -> list[int]:
    """The durable steps retention deletes, given the tier's committed steps and whether each is consistent, when
    `newest` is the newest this run made durable (uploads go newest first: one committed after it is older)."""
    policy = retention.RetentionPolicy(keep_last=keep_last, keep_older_than_steps=keep_older_than_steps)
    own = [(s, ok) for s, ok in listed if s <= newest]
    return retention.retention_victims(own, policy, protect={newest}, pinned=pinned)
