"""`ftsup ckpt import-deepspeed`: a DeepSpeed ZeRO checkpoint's fp32 weights, consolidated as DeepSpeed's zero_to_fp32
lays them out, written in the Hugging Face Hub's layout one tensor in memory at a time (docs/deepspeed.md, Converting).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ftsup.store import hublayout, layout
from ftsup.store.errors import CheckpointCorruptError, CheckpointError
from ftsup.store.torchzip import Archive, TensorRef
from ftsup.trainer.checkpoint import codec
from ftsup.trainer.deepspeed import tags
from ftsup.trainer.hf.export import check_out, write_published
from ftsup.trainer.hf.write import OutTensor


def find_tag(path: str | os.PathLike[str], tag: str | None = None) -> tuple[tags.Tag, list[tags.PassedOver]]:
    """The tag to convert: `path/tag`; `path` itself when it holds a tag's files (an ftsup store's `step-N/` of a
    DeepSpeed job is one); else the newest whole tag of the save directory `path`; else, when `path` is ftsup's store
    of a DeepSpeed job, its newest consistent checkpoint."""
    path = Path(path)
    if tag is not None:
        if not tags.valid_tag_name(tag):
            raise CheckpointError(f"--tag {tag!r}: not a tag name")
        return tags.check_tag(path / tag), []
    if any(n.endswith("_model_states.pt") for n in os.listdir(path)):
        return tags.check_tag(path), []
    found, passed = tags.newest_whole(path)
    if found is None and (info := layout.latest_consistent(path, deep=True)) is not None:
        if layout.read_manifest(info.path).metadata.get("format") == "deepspeed":
            return tags.check_tag(info.path), passed
    if found is None:
        why = "; ".join(f"{p.tag}: {p.reason}" for p in passed) or "no tag"
        raise CheckpointError(f"{path}: no whole DeepSpeed tag to convert ({why})")
    return found, passed


def plan(tag: tags.Tag, archives: Callable[[Path], Archive]) -> list[OutTensor]:
    """Every tensor of the consolidated fp32 state dict, in DeepSpeed's order (buffers, frozen, trained), each read
    when written."""
    if tag.mp_world_size != 1:
        raise CheckpointError(f"{tag.path}: {tag.mp_world_size} tensor-parallel ranks (zero_to_fp32 takes one)")
    if tag.zero_stage not in (1, 2, 3):
        raise CheckpointError(f"{tag.path}: not a ZeRO checkpoint (no optimizer states of a ZeRO stage)")
    models = [_tree(tag, f) for f in tag.model_files]
    optims = [_tree(tag, f)["optimizer_state_dict"] for f in tag.optim_files]
    head, first = models[0], archives(tag.model_files[0])
    out: list[OutTensor] = []
    buffers = head.get("buffer_names") or []
    for name in buffers:
        ref = _ref(head["module"].get(name), tag.model_files[0], name)
        floating = ref.dtype in ("float64", "float32", "float16", "bfloat16")
        out.append(_out(name, "float32" if floating else ref.dtype, ref.shape, [(first, ref, 0, 0, ref.numel)]))
    ws = tag.dp_world_size
    frozen = head.get("frozen_param_shapes") or {}
    for name, shape in frozen.items():
        n = math.prod(shape)
        if tag.zero_stage <= 2:
            ref = _ref(head["frozen_param_fragments"][name], tag.model_files[0], name)
            out.append(_out(name, ref.dtype, tuple(shape), [(first, ref, 0, 0, n)]))
        else:
            pieces, at = [], 0
            for f, m in zip(tag.model_files, models, strict=True):
                ref = _ref(m["frozen_param_fragments"][name], f, name)
                take = min(ref.numel, n - at)
                if take > 0:
                    pieces.append((archives(f), ref, 0, at, take))
                at += take
            out.append(_out(name, "float32", tuple(shape), pieces))
    shapes: list[dict[str, Any]] = head["param_shapes"]
    if tag.zero_stage <= 2:
        out += _zero2(tag, shapes, optims, archives)
    else:
        out += _zero3(tag, shapes, optims, archives, ws)
    names = {t.name: t for t in out}
    for alias, source in (head.get("shared_params") or {}).items():
        if source in names:
            s = names[source]
            out.append(OutTensor(alias, s.dtype, s.shape, s.read))
    return out


def _zero2(
    tag: tags.Tag, shapes: list[dict[str, Any]], optims: list[Any], archives: Callable[[Path], Archive]
) -> list[OutTensor]:
    ws, out = tag.dp_world_size, []
    for g, group in enumerate(shapes):
        parts = [
            _ref(o["single_partition_of_fp32_groups"][g], f, f"group {g}")
            for o, f in zip(optims, tag.optim_files, strict=True)
        ]
        bounds = [0]
        for part in parts:  # the group's flat vector is the ranks' partitions one after the other
            bounds.append(bounds[-1] + part.numel)
        paddings = (optims[0].get("param_alignment_paddings") or [None] * len(shapes))[g]
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            pieces, at = [], offset
            while at < offset + n:
                r = next((k for k in range(ws) if bounds[k] <= at < bounds[k + 1]), None)
                if r is None:
                    raise CheckpointCorruptError(f"{tag.path}: tensor {name!r} runs past the ranks' partitions")
                take = min(bounds[r + 1] - at, offset + n - at)
                pieces.append((archives(tag.optim_files[r]), parts[r], at - bounds[r], at - offset, take))
                at += take
            out.append(_out(name, "float32", tuple(shape), pieces))
            offset += n + (paddings[i] if paddings is not None else 0)
        align = 2 * ws  # zero_to_fp32's check: what the group holds, to its alignment, is what the tensors took
        if align * math.ceil(offset / align) != align * math.ceil(bounds[-1] / align):
            raise CheckpointCorruptError(f"{tag.path}: group {g}: the tensors take {offset} of {bounds[-1]} elements")
    return out


def _zero3(
    tag: tags.Tag, shapes: list[dict[str, Any]], optims: list[Any], archives: Callable[[Path], Archive], ws: int
) -> list[OutTensor]:
    flat = [
        [_ref(t, f, "fp32_flat_groups") for t in o["fp32_flat_groups"]]
        for o, f in zip(optims, tag.optim_files, strict=True)
    ]
    bounds = [0]
    for t in flat[0]:
        bounds.append(bounds[-1] + t.numel)
    merged = {k: v for d in shapes for k, v in d.items()}
    out, offset = [], 0
    for name, shape in merged.items():
        n = math.prod(shape)
        per_rank = math.ceil(n / ws)  # deepspeed.utils.zero_to_fp32.zero3_partitioned_param_info
        pieces = []
        for r in range(ws):
            take = max(0, min(per_rank, n - r * per_rank))
            at, to = offset, r * per_rank
            while take > 0:
                g = next((i for i in range(len(flat[r])) if bounds[i] <= at < bounds[i + 1]), None)
                if g is None:
                    raise CheckpointCorruptError(f"{tag.path}: tensor {name!r} runs past rank {r}'s partitions")
                k = min(take, bounds[g + 1] - at)
                pieces.append((archives(tag.optim_files[r]), flat[r][g], at - bounds[g], to, k))
                at, to, take = at + k, to + k, take - k
        out.append(_out(name, "float32", tuple(shape), pieces))
        offset += per_rank
    if offset != bounds[-1]:
        raise CheckpointCorruptError(f"{tag.path}: the tensors take {offset * ws} of {bounds[-1] * ws} elements")
    return out


Piece = tuple[Archive, TensorRef, int, int, int]  # (file, tensor, its first element, where in the output, how many)


def _out(name: str, dtype: str, shape: tuple[int, ...], pieces: list[Piece]) -> OutTensor:
    torch_dtype = codec.dtype_from_name(dtype, name)
    for _, ref, _, _, _ in pieces:
        if ref.dtype != dtype:
            raise CheckpointCorruptError(f"tensor {name!r}: saved as {ref.dtype}, not {dtype}")

    def read() -> torch.Tensor:
        t = torch.empty(math.prod(shape), dtype=torch_dtype)
        view = t.view(torch.uint8).numpy().data.cast("B") if t.numel() else memoryview(b"")
        size = t.element_size()
        for archive, ref, start, to, count in pieces:
            archive.read_into(ref, start, view[to * size : (to + count) * size])
        return t.view(shape)

    return OutTensor(name, torch_dtype, shape, read)


def _ref(value: Any, path: Path, what: str) -> TensorRef:
    if not isinstance(value, TensorRef):
        raise CheckpointCorruptError(f"{path}: {what} is not a tensor ({type(value).__name__})")
    if not value.contiguous:
        raise CheckpointCorruptError(f"{path}: {what} is not contiguous")
    return value


def _tree(tag: tags.Tag, path: Path) -> Any:
    got = tag.tree_of.get(path)
    if got is None:
        with Archive(path) as a:
            got = a.tree()
    if not isinstance(got, dict):
        raise CheckpointCorruptError(f"{path}: not a DeepSpeed states file")
    return got


def import_deepspeed(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    max_shard_bytes: int = hublayout.DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write the fp32 weights of a DeepSpeed ZeRO checkpoint (`find_tag`) into `out` in the Hub's layout (`out` must
    not exist or be empty; it appears only when complete); the index, its metadata naming the tag and its step."""
    out = Path(out)
    check_out(out)
    found, _passed = find_tag(path, tag)
    with ExitStack() as stack:
        opened: dict[Path, Archive] = {}

        def archive(p: Path) -> Archive:
            if p not in opened:
                opened[p] = stack.enter_context(Archive(p))
            return opened[p]

        index = write_published(out, plan(found, archive), max_shard_bytes, progress)
    index["metadata"].update(deepspeed_tag=str(found.path), step=found.global_steps, zero_stage=found.zero_stage)
    return index
