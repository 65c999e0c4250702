"""What the checkpoint engine learns from the rank's runtime (`ftsup.trainer.runtime`): the tiers and the node the
supervisor named, and the figures a save reports back to it.
"""

from __future__ import annotations

from ftsup import memtier, protocol
from ftsup.store.errors import CheckpointError
from ftsup.trainer.checkpoint.commit import SaveResult
from ftsup.trainer.runtime import runtime


def report_duration(result: SaveResult) -> None:
    """Tell this rank's supervisor how long the save took (the `save_s` figure of a heartbeat, from
    which it estimates whether an emergency save fits before an eviction's deadline and sets
    ftsup_save_duration_seconds), the step now committed in the store (which steps an eviction would lose), and
    that the save made the vanished store's directory again. A no-op without a supervisor; never raises."""
    try:
        client = runtime()
    except ValueError:  # a malformed FTSUP_* variable: the training script hears of it from its own runtime()
        return
    figures: dict[str, float | int] = {"save_s": result.durable_s}
    if not result.fallback:  # a checkpoint in the fallback directory is not a resume point by itself
        figures[protocol.COMMITTED_STEP] = result.step
    if result.recreated:
        figures[protocol.DIR_RECREATED_STEP] = result.step
    client.report(**figures)


def report_memory(step: int, *, peers: bool = False) -> None:
    """Tell this rank's supervisor that checkpoint `step` is committed in the node's memory tier (the `memory_step`
    figure), or with `peers` in the peers' memories too (`peers_step`): which tiers an eviction's checkpoint
    reached. A no-op without a supervisor; never raises."""
    try:
        client = runtime()
    except ValueError:
        return
    client.report(**{protocol.PEERS_STEP if peers else protocol.MEMORY_STEP: step})


def fallback_dir() -> str | None:
    """FALLBACK_DIR_ENV, as the rank's runtime read it (None where a malformed FTSUP_* variable made that fail)."""
    try:
        return runtime().env.fallback_dir
    except ValueError:
        return None


def memory_tier() -> memtier.MemoryTier | None:
    """MEMORY_TIER_ENV as the rank's runtime read it; a malformed value of it is a CheckpointError naming it."""
    try:
        return runtime().env.memory_tier
    except ValueError as e:
        if protocol.MEMORY_TIER_ENV in str(e):
            raise CheckpointError(str(e)) from None
        return None


def durable_tier() -> str | None:
    """FTSUP_CHECKPOINT_DURABLE, as the rank's runtime read it (None where a malformed FTSUP_* variable made that
    fail: the training script hears of it from its own runtime())."""
    try:
        return runtime().env.durable_tier
    except ValueError:
        return None


def node() -> tuple[str | None, bool]:
    """(this node, whether this rank is its first local rank) where each node keeps its own checkpoint directory
    (FTSUP_CHECKPOINT_NODE_LOCAL, which `ftsup run` sets from `checkpoint.dir_shared: false`); (None, False) else."""
    try:
        env = runtime().env
    except ValueError:
        return None, False
    return (env.node_id, env.local_rank == 0) if env.node_local and env.node_id else (None, False)


def node_id() -> tuple[str | None, int]:
    """(FTSUP_NODE_ID, LOCAL_RANK) as the rank's runtime read them; (None, 0) without them."""
    try:
        env = runtime().env
    except ValueError:
        return None, 0
    return env.node_id, env.local_rank
