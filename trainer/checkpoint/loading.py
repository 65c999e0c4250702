"""Loading: the latest consistent (or a given) checkpoint, into the caller's state, on any world size; a corrupt one
quarantined and the next older tried (trainer/checkpoint/DESIGN.md, Loading, Fallback).

Not here: the reader's byte ranges and verified reads (`reader`, `shardio`), saving.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ftsup.extras import MissingExtraError
from ftsup.store import choice, dcpmeta, layout, safefile, tiers
from ftsup.store.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    DurableTierError,
    NoCheckpointError,
)
from ftsup.trainer.checkpoint import codec, loadplan
from ftsup.trainer.checkpoint.comm import GroupComm, LocalComm
from ftsup.trainer.checkpoint.durableread import DurableSource, LazyTier, pick_from
from ftsup.trainer.checkpoint.noderead import NodeRead, NodeSource
from ftsup.trainer.checkpoint.peerload import Restored
from ftsup.trainer.checkpoint.reader import ShardReader
from ftsup.trainer.runtime import runtime

log = structlog.get_logger("ftsup.checkpoint")


@dataclass(frozen=True)
class LoadResult:
    step: int
    path: str
    kind: str
    saved_world_size: int
    metadata: Mapping[str, Any]
    rank_state: Any  # this rank's saved rank_state, or None (rank >= saved world size)
    bytes_read: int
    load_s: float
    tier: str = tiers.FAST
    """Where it was read from: `tiers.FAST` (the local store), `MEMORY` (the node's memory tier), `PEERS` (a copy made
    from the nodes' memories, a part of it from another node or a replica) or `tiers.DURABLE`."""


MEMORY = "memory"
PEERS = "peers"


def load(
    directory: Path,
    comm: LocalComm | GroupComm,
    state: Mapping[str, Any],
    *,
    step: int | None,
    at_most: int | None,
    check: Callable[[Mapping[str, Any]], None] | None,
    durable_tier: str | None = None,
    node_local: bool = False,
    pool: ThreadPoolExecutor | None = None,
    memory: Path | None = None,
    restored: Restored | None = None,
    started: float | None = None,
    flat: dict[str, torch.Tensor] | None = None,
) -> LoadResult:
    """`CheckpointEngine.load` (see there); a collective over the engine's group. `durable_tier`: the durable
    tier's location, where a checkpoint newer than the local store's consistent ones may be read from.
    `node_local`: `directory` is this rank's node's own; each rank reads what its node's copy of the chosen
    checkpoint holds from there, the rest from the durable tier (`noderead`). `pool`: the engine's reading
    threads, for the local store's files. `memory`: the node's memory tier, read instead of the store where it
    holds the checkpoint chosen, verified; a copy there that fails is passed over and the store's is read.
    `restored`: the whole copy this rank's node made of the newest checkpoint its nodes hold (`peerload`), read
    first; passed over, and the store's choice made, where it fails. `started`: when the caller's load began (its
    `time.perf_counter()`), counted in `load_s`: the copy made from the peers is a part of the load. `flat`: `state`
    flattened (`codec.flatten`), where the caller has done it already."""
    t0 = time.perf_counter() if started is None else started
    if flat is None:
        flat, _ = codec.flatten(codec.state_dicts(state))
    given_up: list[choice.Passed] = []  # rank 0's: what was passed over, for the error if nothing is left
    in_memory = _MemoryCopies(memory)
    tier = LazyTier(durable_tier, _durable_timeout_s())
    try:
        while True:
            with tier.bounded():  # one checkpoint's reads from the tier: one it cannot deliver in time is passed over
                chosen: dict[str, Any] | None = None
                if comm.rank == 0:
                    chosen = _restored(restored) if restored is not None else None
                    chosen = chosen or in_memory.instead(_choose(directory, step, at_most, given_up, tier))
                chosen = comm.broadcast(chosen)
                if chosen.get("restored") and restored is not None:  # each node reads its own copy, of what it holds
                    chosen = dict(
                        chosen, path=str(restored.path), tier=restored.tier, held=restored.held, kept=restored.kept
                    )
                if "error" in chosen:
                    raise NoCheckpointError(chosen["error"], rejected=chosen["rejected"])
                from_tier = chosen.get("tier") == tiers.DURABLE
                try:
                    node = NodeRead(directory, tier) if node_local and not chosen.get("restored") else None
                    return _load_from(comm, chosen, state, flat, t0, check, tier if from_tier else None, node, pool)
                except (CheckpointCorruptError, DurableTierError) as e:
                    if chosen.get("restored"):  # the store's choice is made next
                        log.warning("checkpoint_peer_passed_over", step=chosen["step"], rank=comm.rank, reason=str(e))
                        restored = None
                        continue
                    if chosen.get("tier") == MEMORY:  # the store's copy of the same step is read next
                        in_memory.passed_over(chosen, str(e), comm.rank)
                        continue
                    if step is not None or not (from_tier or isinstance(e, CheckpointCorruptError)):
                        raise
                    if comm.rank == 0 and (from_tier or node_local):  # a tier, or a copy that may be good where
                        # another node's file failed, is never renamed into: passed over, left as it is
                        _passed_over(choice.Passed(chosen["path"], chosen["step"], choice.SKIPPED, str(e)), given_up)
                    elif comm.rank == 0:
                        _passed_over(choice.give_up(chosen["path"], chosen["step"], str(e)), given_up)
            _still_loading()
    finally:
        tier.close()


def _restored(restored: Restored) -> dict[str, Any] | None:
    """Rank 0: the whole copy made from the nodes' memories, as `_choose` returns a checkpoint; None (logged) when
    its manifest or metadata fail."""
    try:
        manifest = layout.read_manifest(restored.path)
        packed = (
            restored.meta if restored.meta is not None else loadplan.pack(read_dcp_metadata(restored.path, manifest))
        )
    except (CheckpointError, OSError) as e:
        log.warning("checkpoint_peer_passed_over", step=restored.step, rank=0, reason=str(e))
        return None
    return {
        "tier": restored.tier,
        "restored": True,
        "step": manifest.step,
        "path": str(restored.path),
        "manifest": manifest.to_json(),
        "meta": packed,
    }


class _MemoryCopies:
    """Rank 0: the memory tier's copy of the checkpoint chosen, where it holds one that passes the fast check, and
    its metadata verified; each copy that failed passed over for the rest of the load."""

    def __init__(self, memory: Path | None) -> None:
        self.memory = memory
        self.passed: set[str] = set()

    def instead(self, chosen: dict[str, Any]) -> dict[str, Any]:
        if self.memory is None or "error" in chosen or chosen.get("tier") == tiers.DURABLE:
            return chosen
        where = self.memory / layout.step_dirname(chosen["step"])
        if str(where) in self.passed:
            return chosen
        try:
            info = layout.find_checkpoint(self.memory, chosen["step"])
            if not info.consistent:
                raise CheckpointCorruptError("; ".join(map(str, info.problems)), path=str(info.path))
            manifest = layout.read_manifest(info.path)
            meta = read_dcp_metadata(Path(info.path), manifest)
        except NoCheckpointError:
            return chosen  # not there (made before the tier, or let go by its retention)
        except (CheckpointError, OSError) as e:
            self.passed_over({"step": chosen["step"], "path": str(where)}, str(e), 0)
            return chosen
        packed, path = loadplan.pack(meta), str(info.path)
        return {"tier": MEMORY, "step": info.step, "path": path, "manifest": manifest.to_json(), "meta": packed}

    def passed_over(self, chosen: Mapping[str, Any], reason: str, rank: int) -> None:
        """Never read again in this load (left as it is: its retention lets it go); the store's copy is read."""
        self.passed.add(chosen["path"])
        if rank == 0:
            log.warning("checkpoint_memory_passed_over", step=chosen["step"], path=chosen["path"], reason=reason)


def _durable_timeout_s() -> float | None:
    """FTSUP_CHECKPOINT_DURABLE_TIMEOUT_S as this rank's runtime read it (None without it, or where a malformed
    FTSUP_* variable made that fail: the training script hears of it from its own runtime())."""
    try:
        return runtime().env.durable_timeout_s
    except ValueError:
        return None


def _still_loading() -> None:
    """A checkpoint was passed over: tell the supervisor this rank still loads, so that its silence in `load`
    counts from here (the next checkpoint's read gets the whole of it)."""
    try:
        runtime().report()
    except ValueError:
        pass


def read_rank_state(checkpoint_path: str | os.PathLike[str], rank: int) -> Any:
    """Any rank's saved rank_state (verified), e.g. to re-deal RNG streams on a new world size."""
    path = Path(checkpoint_path)
    manifest = layout.read_manifest(path)
    if layout.rank_state_name(rank) not in manifest.files:
        raise NoCheckpointError(f"{path} has no rank_state for rank {rank} (saved on {manifest.world_size})")
    return _read_own_rank_state(path, manifest, rank)


def _choose(
    directory: Path, step: int | None, at_most: int | None, given_up: list[choice.Passed], tier: LazyTier
) -> dict[str, Any]:
    """Rank 0: the checkpoint to load and its verified DCP metadata (or why there is none).
    Loading "latest" (or at most a step), whatever fails is passed over (`choice`), logged and
    added to `given_up`; loading a given step, its failure is the error. With a durable tier, a
    checkpoint of it newer than the local store's choice is chosen (`tiers`), a given step the local
    store does not hold consistent is read from it."""
    while True:
        if step is not None:
            try:
                info = layout.find_checkpoint(directory, step)
            except NoCheckpointError as e:
                return _durable_step(tier, step) if tier.usable else {"error": str(e), "rejected": []}
            if not info.consistent:
                if tier.usable:
                    return _durable_step(tier, step)
                return {
                    "error": f"checkpoint {info.path} is not consistent: {'; '.join(map(str, info.problems))}",
                    "rejected": [],
                }
        else:
            # Failing the fast check here is skipped, not quarantined: the supervisor (or an
            # operator) decides that; one that fails while loading is quarantined below.
            picked = choice.choose(directory, at_most=at_most, quarantine=False, exclude={p.path for p in given_up})
            for p in picked.passed:
                _passed_over(p, given_up)
            durable_chosen = _durable_latest(picked, tier, at_most, given_up)
            if durable_chosen is not None:
                if "error" in durable_chosen:
                    continue  # its metadata did not verify: passed over, choose again
                return durable_chosen
            if picked.info is None:
                bound = f" of step <= {at_most}" if at_most is not None else ""
                rejected = [str(p) for p in given_up]
                shown = "; ".join(rejected[:5]) + ("; ..." if len(rejected) > 5 else "")
                unusable = f" ({len(rejected)} unusable: {shown})" if rejected else ""
                return {"error": f"no consistent checkpoint{bound} under {directory}{unusable}", "rejected": rejected}
            info = picked.info
        try:
            manifest = layout.read_manifest(info.path)
            meta = read_dcp_metadata(Path(info.path), manifest)
        except CheckpointError as e:  # it changed since the check, or its metadata is corrupt
            if step is not None:
                return {"error": str(e), "rejected": []}
            _passed_over(choice.give_up(info.path, info.step, str(e)), given_up)
            continue
        # Packed by tensor: each rank unpacks only its own tensors' chunks (`loadplan`).
        return {"step": info.step, "path": info.path, "manifest": manifest.to_json(), "meta": loadplan.pack(meta)}


def _durable_latest(
    fast: choice.Choice, tier: LazyTier, at_most: int | None, given_up: list[choice.Passed]
) -> dict[str, Any] | None:
    """Rank 0: the durable tier's checkpoint newer than the local choice `fast`, as `_choose` returns it; None when
    there is none (or no tier, or the tier failed: the local choice stands); {"error"} when the one chosen failed
    (passed over, in `given_up`)."""
    if not tier.usable:
        return None
    try:
        both = tiers.across(fast, tier.get(), at_most=at_most, exclude={p.path for p in given_up})
    except (CheckpointError, MissingExtraError, OSError) as e:  # the tier down, no boto3, a location refused
        tier.failed = True  # the rest of this load goes on without it
        log.warning("durable_choice_failed", reason=str(e), step=fast.info.step if fast.info else None)
        return None
    for p in both.passed[len(fast.passed) :]:
        _passed_over(p, given_up)
    if both.durable is None:
        return None
    return _durable_chosen(tier, both.durable, given_up)


def _durable_step(tier: LazyTier, step: int) -> dict[str, Any]:
    """Rank 0: the durable checkpoint of a given `step`, as `_choose` returns it, or the error."""
    try:
        pick = tiers.find_durable(tier.get(), step)
    except (CheckpointError, MissingExtraError, OSError) as e:
        return {
            "error": f"step {step}: not consistent in the local store nor in the durable tier ({e})",
            "rejected": [],
        }
    return _durable_chosen(tier, pick, [])


def _durable_chosen(tier: LazyTier, pick: tiers.DurablePick, given_up: list[choice.Passed]) -> dict[str, Any]:
    """What rank 0 broadcasts for the durable checkpoint `pick`: its manifest's bytes and its verified metadata."""
    try:
        meta = tiers.read_dcp_metadata(tier.get(), pick)
    except (CheckpointError, MissingExtraError, OSError) as e:
        _passed_over(choice.Passed(pick.info.path, pick.step, choice.SKIPPED, str(e)), given_up)
        return {"error": str(e), "rejected": []}
    return {
        "tier": tiers.DURABLE,
        "step": pick.step,
        "path": pick.info.path,
        "raw": pick.raw,
        "manifest": pick.manifest.to_json(),
        "meta": loadplan.pack(meta),
    }


def _passed_over(p: choice.Passed, given_up: list[choice.Passed]) -> None:
    given_up.append(p)
    if p.action == choice.QUARANTINED:
        log.error("checkpoint_quarantined", step=p.step, reason=p.reason, path=p.moved_to)
    else:
        log.warning("checkpoint_skipped", step=p.step, reason=p.reason, path=p.path)


def read_dcp_metadata(path: Path, manifest: layout.Manifest) -> dict[str, Any]:
    """A checkpoint's `dcp_metadata.json`, verified and its schema checked (`dcpmeta.read`)."""
    return dcpmeta.read(path, manifest)


def _load_from(
    comm: LocalComm | GroupComm,
    chosen: dict[str, Any],
    state: Mapping[str, Any],
    flat: dict[str, torch.Tensor],
    t0: float,
    check: Callable[[Mapping[str, Any]], None] | None,
    tier: LazyTier | None = None,
    node: NodeRead | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> LoadResult:
    """Load the chosen checkpoint: from the local store, or (`tier`) from the durable tier; `node`: each file from
    this rank's node's copy where it holds it, else from the durable tier."""
    path: Path | str = Path(chosen["path"]) if tier is None else chosen["path"]
    manifest = layout.parse_manifest(json.dumps(chosen["manifest"]))
    meta = chosen["meta"]
    source: DurableSource | NodeSource | None = None
    if check is not None:
        check(manifest.metadata)  # the same metadata on every rank: all raise or none does
    mismatches = _mismatches(meta["tensors"], flat)
    rank_state: Any = None
    status = 0  # 0 fine, 1 corrupt, 2 mismatch: agreed by all ranks before any byte moves
    corrupt: CheckpointCorruptError | DurableTierError | None = None
    if mismatches:
        status = 2
    else:
        try:
            if node is not None:
                durable_pick = DurableSource(tier.get(), pick_from(chosen)) if tier is not None else None
                source = NodeSource(
                    node.directory / layout.step_dirname(manifest.step), manifest, node.tier, durable_pick
                )
                rank_state = _read_node_rank_state(source, comm.rank)
            elif tier is None:
                rank_state = _read_own_rank_state(Path(path), manifest, comm.rank, chosen.get("held"))
            else:
                source = DurableSource(tier.get(), pick_from(chosen))
                rank_state = _read_durable_rank_state(source, comm.rank)
        except CheckpointCorruptError as e:
            status, corrupt = 1, e
        except (CheckpointError, MissingExtraError, OSError) as e:  # reading the durable tier failed on this rank
            status, corrupt = 1, e if isinstance(e, DurableTierError) else DurableTierError(f"{path}: {e}")
    agreed = comm.all_reduce_max(status)
    if agreed == 2:
        shown = "; ".join(mismatches[:20]) or "(reported by another rank)"
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit the state being loaded ({len(mismatches)} mismatched keys): "
            f"{shown}; nothing was loaded",
            keys=[m.split(":")[0] for m in mismatches],
        )
    if agreed == 1:
        raise corrupt or CheckpointCorruptError(f"{path}: another rank found a corrupt file", path=str(path))
    reader = ShardReader(
        path, manifest, meta, comm, source, names=flat, pool=pool, held=chosen.get("held"), kept=chosen.get("kept")
    )
    reader.load(flat, DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=False))
    rebuilt = codec.rebuild(meta["skeleton"], flat)
    for key, value in state.items():
        if codec.is_stateful(value):
            value.load_state_dict(rebuilt[key])
        elif isinstance(state, dict):
            state[key] = rebuilt[key]
    load_s = time.perf_counter() - t0
    where = tiers.FAST if tier is None else tiers.DURABLE
    where = chosen["tier"] if chosen.get("tier") in (MEMORY, PEERS) else where
    bytes_read = reader.bytes_read + (source.bytes_read if source is not None else 0)
    if isinstance(source, NodeSource):
        log.info("checkpoint_node_read", **source.report(comm.rank))
    log.info(
        "checkpoint_loaded",
        step=manifest.step,
        rank=comm.rank,
        duration_s=round(load_s, 4),
        path=str(path),
        bytes_read=bytes_read,
        tier=where,
    )
    return LoadResult(
        step=manifest.step,
        path=str(path),
        kind=manifest.kind,
        saved_world_size=manifest.world_size,
        metadata=manifest.metadata,
        rank_state=rank_state,
        bytes_read=bytes_read,
        load_s=load_s,
        tier=where,
    )


def _read_own_rank_state(path: Path, manifest: layout.Manifest, rank: int, held: Collection[str] | None = None) -> Any:
    name = layout.rank_state_name(rank)
    if name not in manifest.files:
        return None  # this rank did not exist when the checkpoint was saved
    if held is not None and name not in held:
        raise CheckpointCorruptError(
            f"{path}: {name} is not in this copy (the restore did not fetch it)", path=str(path)
        )
    raw = layout.read_verified(path, manifest, name, layout.RANK_STATE_MAX_BYTES)
    return _decode_rank_state(raw, str(path), f"{path}/{name}", name)


def _read_node_rank_state(source: NodeSource, rank: int) -> Any:
    name = layout.rank_state_name(rank)
    if name not in source.manifest.files:
        return None
    raw = source.read_small(name, layout.RANK_STATE_MAX_BYTES)
    return _decode_rank_state(raw, str(source.local), f"{source.local}/{name}", name)


def _read_durable_rank_state(source: DurableSource, rank: int) -> Any:
    name = layout.rank_state_name(rank)
    pick = source.pick
    if name not in pick.manifest.files:
        return None
    raw = tiers.read_verified(source.tier, pick, name, layout.RANK_STATE_MAX_BYTES)
    source.bytes_read += len(raw)
    return _decode_rank_state(raw, pick.info.path, tiers.object_url(source.tier, pick.step, pick.token, name), name)


def _decode_rank_state(raw: bytes, path: str, where: str, name: str) -> Any:
    try:
        return codec.decode_inline(safefile.loads(raw, where))
    except CheckpointCorruptError:
        raise
    except CheckpointError as e:  # a well-checksummed file that is not a rank state
        raise CheckpointCorruptError(f"{where}: {e}", path=path, file=name) from None


def _mismatches(saved: Mapping[str, Any], flat: Mapping[str, torch.Tensor]) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(flat)):
        if key not in flat:
            out.append(f"{key}: in the checkpoint but not in the state being loaded")
        elif key not in saved:
            out.append(f"{key}: in the state being loaded but not in the checkpoint")
        else:
            s, t = saved[key], flat[key]
            if list(t.shape) != s["size"]:
                out.append(f"{key}: shape {list(t.shape)} != saved {s['size']}")
            elif codec.dtype_name(t.dtype) != s["dtype"]:
                out.append(f"{key}: dtype {codec.dtype_name(t.dtype)} != saved {s['dtype']}")
    return out
