"""A DeepSpeed checkpoint tag (`save_dir/<tag>/`) checked whole before anything loads it, and the newest whole tag of a
save directory. Torch-free: every file is read as a `torch.save` archive without running its pickle (docs/deepspeed.md,
What resumes).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftsup.store import safefile
from ftsup.store.errors import CheckpointCorruptError, CheckpointError
from ftsup.store.torchzip import Archive, Stub

LATEST = "latest"  # the file DeepSpeed's save_checkpoint writes, naming the tag its load_checkpoint reads
MAX_LATEST_BYTES = 4096
MAX_TAGS = 100_000
_TAG = re.compile(r"[A-Za-z0-9_.+=-]{1,200}\Z")
_STEP_TAG = re.compile(r"global_step(\d{1,15})\Z")
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt\Z")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt\Z")


@dataclass(frozen=True)
class Tag:
    """A whole tag: what every file of it says, checked against the others."""

    path: Path
    zero_stage: int
    dp_world_size: int
    global_steps: int | None
    model_files: tuple[Path, ...]
    optim_files: tuple[Path, ...]  # dp rank order (one tensor-parallel rank: mp_rank_00)
    mp_world_size: int = 1
    tree_of: dict[Path, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class PassedOver:
    tag: str
    reason: str


def valid_tag_name(name: str) -> bool:
    return bool(_TAG.match(name)) and name not in (".", "..")


def read_latest(save_dir: str | os.PathLike[str]) -> str | None:
    """The tag `save_dir/latest` names; None when there is no such file. CheckpointCorruptError when it is not a
    small regular file naming a tag (an empty one: a save killed while it wrote it)."""
    path = Path(save_dir) / LATEST
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None
    raw = safefile.read_regular(path, str(path), MAX_LATEST_BYTES, error=CheckpointCorruptError)
    name = raw.decode("utf-8", "replace").strip()
    if not valid_tag_name(name):
        raise CheckpointCorruptError(f"{path}: does not name a tag ({name!r:.60})")
    return name


def check_tag(path: str | os.PathLike[str]) -> Tag:
    """The tag at `path` when every file a resume reads is there and whole; CheckpointError naming the first that is
    not (a rank's file missing, a file cut short, ranks that disagree on how many they were)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: no such tag directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointCorruptError(f"{path}: not a directory (a link or a file)")
    names = sorted(os.listdir(path))
    models: dict[tuple[int, int], Path] = {}
    optims: dict[tuple[int, int], Path] = {}
    for name in names[: MAX_TAGS + 1]:
        if (m := _MODEL.match(name)) is not None:
            models[(int(m.group(1) or 0), int(m.group(2)))] = path / name
        elif (m := _OPTIM.match(name)) is not None:
            optims[(int(m.group(1)), int(m.group(2)))] = path / name
    if not models:
        raise CheckpointCorruptError(f"{path}: no *_model_states.pt (not a DeepSpeed tag, or its save was cut short)")
    mp_ranks = sorted({mp for _, mp in models})
    if mp_ranks != list(range(len(mp_ranks))):
        raise CheckpointCorruptError(f"{path}: model states of tensor-parallel ranks {mp_ranks}: one is missing")
    trees: dict[Path, Any] = {}
    first = models[min(models)]
    trees[first] = _tree(first)
    meta = trees[first]
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{first}: not a DeepSpeed model states file")
    stage, dp = 0, _int(meta.get("dp_world_size"), first, "dp_world_size")
    if optims:
        head = optims.get((0, 0))
        if head is None:
            raise CheckpointCorruptError(f"{path}: zero_pp_rank_0_mp_rank_00_optim_states.pt is missing")
        trees[head] = _tree(head)
        osd = trees[head].get("optimizer_state_dict") if isinstance(trees[head], dict) else None
        if not isinstance(osd, dict):
            raise CheckpointCorruptError(f"{head}: not a ZeRO optimizer states file")
        stage = _stage(osd.get("zero_stage"), head)
        count = osd.get("partition_count")
        dp = _int(max(count) if isinstance(count, list) and count else count, head, "partition_count")
    for mp in mp_ranks:
        if optims and (missing := _first_missing(optims, dp, mp)) is not None:
            raise CheckpointCorruptError(
                f"{path}: {dp} ranks saved ZeRO optimizer states, the file of dp rank {missing} is missing"
            )
        if stage == 3 and (missing := _first_missing(models, dp, mp)) is not None:
            raise CheckpointCorruptError(f"{path}: the ZeRO-3 model states of dp rank {missing} are missing")
    extra = [k for k in optims if k[0] >= dp]
    if extra:
        raise CheckpointCorruptError(f"{path}: optimizer states of dp rank {extra[0][0]}, past the {dp} that saved")
    for file in [*models.values(), *optims.values()]:
        if file not in trees:
            with Archive(file):  # whole: its central directory is there and every member inside the file
                pass
    steps = meta.get("global_steps")
    return Tag(
        path=path,
        zero_stage=stage,
        dp_world_size=dp,
        global_steps=steps if isinstance(steps, int) else None,
        model_files=tuple(models[k] for k in sorted(models, key=lambda k: (k[1], k[0]))),
        optim_files=tuple(optims[(d, 0)] for d in range(dp)) if optims else (),
        mp_world_size=len(mp_ranks),
        tree_of=trees,
    )


def newest_whole(save_dir: str | os.PathLike[str]) -> tuple[Tag | None, list[PassedOver]]:
    """The tag `latest` names when it is whole, else the newest whole `global_stepN` (DeepSpeed's default tags); what
    was passed over, and why. (None, ...) when no tag is whole."""
    save_dir = Path(save_dir)
    passed: list[PassedOver] = []
    candidates: list[str] = []
    try:
        latest = read_latest(save_dir)
        if latest is not None:
            candidates.append(latest)
    except CheckpointError as e:
        passed.append(PassedOver(LATEST, str(e)))
    try:
        entries = os.listdir(save_dir)[:MAX_TAGS]
    except FileNotFoundError:
        entries = []
    numbered = sorted(((int(m.group(1)), n) for n in entries if (m := _STEP_TAG.match(n))), reverse=True)
    candidates += [n for _, n in numbered if n not in candidates]
    for name in candidates:
        try:
            return check_tag(save_dir / name), passed
        except CheckpointError as e:
            passed.append(PassedOver(name, str(e)))
    return None, passed


def _first_missing(have: dict[tuple[int, int], Path], dp: int, mp: int) -> int | None:
    """The first dp rank of tensor-parallel rank `mp` without a file in `have`: never more steps than files, whatever
    `dp` a file claims."""
    return next((d for d in range(dp) if (d, mp) not in have), None)


def _tree(path: Path) -> Any:
    with Archive(path) as a:
        return a.tree()


def _int(value: Any, path: Path, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 24:
        raise CheckpointCorruptError(f"{path}: {key} is {value!r:.40}, not a number of ranks")
    return value


def _stage(value: Any, path: Path) -> int:
    got = value.args[0] if isinstance(value, Stub) and value.args else value
    if not isinstance(got, int) or got not in (1, 2, 3):
        raise CheckpointCorruptError(f"{path}: zero_stage is {value!r:.40}")
    return got
