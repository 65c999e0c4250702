"""The plan of a chaos run (`ftsup chaos`): which faults, in which order, aimed at which moments, all drawn from one
seed, so that the same seed throws the same faults at the same steps. Pure: no process, no file, no clock.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

KINDS: dict[str, str] = {
    "kill-rank": "SIGKILL a rank",
    "stop-rank": "SIGSTOP a rank (a hang)",
    "straggler": "a rank slowed (stopped and continued in turns), never stopped for long",
    "exit-rank": "a rank exits with status 3 (--fault-file)",
    "kill-torchrun": "SIGKILL the torchrun agent",
    "kill-supervisor": "SIGKILL the supervisor, started again as systemd would (RestartSec)",
    "evict-signal": "an eviction notice by signal to the supervisor; the job started again, as a requeue",
    "evict-metadata": "an eviction notice from a cloud metadata server (aws, gcp or azure); started again",
    "node-loss": "one node of two lost (its supervisor SIGKILLed, its ranks follow), then back",
    "disk-full": "the checkpoint filesystem (a size-limited tmpfs) full while a save is due",
    "flip-byte": "a byte flipped in the newest checkpoint's shard, then a rank SIGKILLed so that it is loaded",
    "kill-in-commit": "SIGKILL a rank during a commit (its shard, or the DCP metadata or manifest, written)",
}
NODE_KINDS = frozenset({"node-loss"})  # thrown at the two-supervisor job; every other kind at the one-node job
SIGNALS = ("SIGTERM", "SIGUSR1")  # eviction.signals of the job
PROVIDERS = ("aws", "gcp", "azure")
# The reference trainer's commit hook points (ftsup.trainer.examples.faults.COMMIT_POINTS; a unit
# test holds the two equal): a shard written is every rank's, the DCP metadata and the manifest rank 0's.
COMMIT_POINTS = ("shard_written", "metadata_written", "manifest_written")
RANK0_POINTS = frozenset({"metadata_written", "manifest_written"})
CKPT_EVERY = 5  # the jobs' periodic checkpoint interval, in steps
GAP_STEPS = (3, 12)  # inclusive bounds of the steps trained between two faults
STRAGGLER_STEPS = 12  # the straggler's window, in steps at the job's usual pace
DISK_FULL_STEPS = 3  # how many periodic saves' intervals the store may stay full at most


@dataclass(frozen=True)
class Planned:
    """One fault of the plan."""

    index: int  # 1-based order in the plan
    kind: str
    gap_steps: int  # steps past the furthest step reached, once the previous fault is over
    delay_frac: float  # then this fraction of a step's time later
    rank: int  # the rank it targets (rank faults; flip-byte: the rank killed, and the shard flipped)
    variant: str = ""  # evict-signal: the signal; evict-metadata: the provider; kill-in-commit: the point

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(n: int, seed: int, kinds: tuple[str, ...] = tuple(KINDS), nproc: int = 2) -> list[Planned]:
    """`n` faults of `kinds` (every kind once when n >= len(kinds)), drawn from `seed`."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown fault kind(s) {unknown}; the kinds are {', '.join(KINDS)}")
    rng = random.Random(seed)
    order = rng.sample(kinds, n) if n < len(kinds) else [*kinds, *rng.choices(kinds, k=n - len(kinds))]
    rng.shuffle(order)
    out = []
    for i, kind in enumerate(order, start=1):
        rank = rng.randrange(nproc)
        variant = ""
        if kind == "evict-signal":
            variant = rng.choice(SIGNALS)
        elif kind == "evict-metadata":
            variant = rng.choice(PROVIDERS)
        elif kind == "kill-in-commit":
            variant = rng.choice(COMMIT_POINTS)
            rank = 0 if variant in RANK0_POINTS else rank
        out.append(Planned(i, kind, rng.randint(*GAP_STEPS), round(rng.random(), 3), rank, variant))
    return out


def steps_needed(plan: list[Planned], ckpt_every: int) -> int:
    """Training steps a job must run so that every fault of `plan` lands before its end, with room left."""
    extra = {
        "straggler": STRAGGLER_STEPS,
        "disk-full": (DISK_FULL_STEPS + 1) * ckpt_every,
        "flip-byte": ckpt_every,
        "kill-in-commit": ckpt_every,
        "node-loss": 2 * ckpt_every,
    }
    return 2 * ckpt_every + sum(f.gap_steps + extra.get(f.kind, 0) + 2 for f in plan) + 3 * ckpt_every
