"""The checkpoint engine in one process: faults, bad input, resource bounds."""

from __future__ import annotations

import gc
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import structlog
import torch

from ftsup.store import layout
from ftsup.trainer.checkpoint import (
    CheckpointCorruptError,
    CheckpointEngine,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    NoCheckpointError,
    RetentionPolicy,
)
from ftsup.trainer.checkpoint.engine import read_rank_state
from ftsup.trainer.checkpoint.stateful import ModelOptimState
from tests.helpers import flip_byte, mounted_tmpfs


def make_state(width: int = 32, seed: int = 0) -> ModelOptimState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    optim.zero_grad()
    return ModelOptimState(model, optim)


def snapshot(state: ModelOptimState) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.state_dict()["model"].items():
        out[f"model.{k}"] = v.detach().clone()
    for p, s in state.state_dict()["optim"]["state"].items():
        for k, v in s.items():
            out[f"optim.{p}.{k}"] = v.detach().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def bump(state: ModelOptimState) -> None:
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)


@pytest.fixture
def engine(tmp_path):
    eng = CheckpointEngine(tmp_path / "ckpt", retention=RetentionPolicy(keep_last=5))
    yield eng
    try:
        eng.close()
    except CheckpointError:
        pass


def test_blocking_save_then_load_restores_model_optimizer_and_rank_state(engine):
    state = make_state()
    want = snapshot(state)
    res = engine.save(
        7,
        {"app": state},
        kind="final",
        rank_state={"rng": torch.get_rng_state(), "t": (1, "a")},
        metadata={"samples": 56},
        block=True,
    )
    assert (res.step, res.kind, Path(res.path).name) == (7, "final", "step-000000007")
    rng = torch.get_rng_state()
    fresh = make_state(seed=1)
    loaded = engine.load({"app": fresh})
    assert (loaded.step, loaded.kind, dict(loaded.metadata)) == (7, "final", {"samples": 56})
    assert same(snapshot(fresh), want)
    assert torch.equal(loaded.rank_state["rng"], rng) and loaded.rank_state["t"] == (1, "a")
    assert fresh.optimizer.param_groups[0]["lr"] == 0.01


def test_the_garbage_collector_is_paused_inside_save_and_load_and_left_as_it_was(tmp_path: Path) -> None:
    seen: list[tuple[str, bool]] = []

    def hook(point: str, step: int) -> None:
        if point == "staged":  # called in the caller's thread, inside save()
            seen.append((point, gc.isenabled()))

    with CheckpointEngine(tmp_path / "ckpt", hook=hook) as eng:
        assert gc.isenabled()
        eng.save(1, {"app": make_state()}, block=True)
        eng.save(2, {"app": make_state()}).wait()
        eng.load({"app": make_state(seed=1)}, check=lambda meta: seen.append(("check", gc.isenabled())))
        assert gc.isenabled()
        with pytest.raises(CheckpointMismatchError):
            eng.load({"app": make_state(width=16)})
        assert gc.isenabled()  # also after an error
        gc.disable()
        try:
            eng.save(3, {"app": make_state()}, block=True)
            assert not gc.isenabled()  # a caller that runs without it keeps it off
        finally:
            gc.enable()
    assert seen == [("staged", False), ("staged", False), ("check", False), ("staged", False)]


def test_shard_files_are_readable_safetensors(engine):
    from safetensors.torch import load_file

    state = make_state()
    res = engine.save(1, {"app": state}, block=True)
    tensors = load_file(os.path.join(res.path, "shard-00000.safetensors"))
    assert torch.equal(tensors["app.model.0.weight@0,0"], state.model[0].weight.detach())


def test_async_save_returns_before_commit_and_reuses_one_staging_buffer(engine):
    state = make_state(width=256)
    handles = [engine.save(s, {"app": state}) for s in range(1, 6)]
    results = [h.wait() for h in handles]
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    assert len(engine._buffers) == 1 and engine._buffers[0] is not None
    ptr = engine._buffers[0].data_ptr()
    engine.save(6, {"app": state}).wait()
    assert engine._buffers[0].data_ptr() == ptr  # reused, not re-allocated per save


def test_saving_a_committed_step_again_never_overwrites_it(engine):
    state = make_state()
    engine.save(3, {"app": state}, block=True)
    before = (Path(engine.directory) / "step-000000003" / "manifest.json").read_bytes()
    bump(state)
    res = engine.save(3, {"app": state}, kind="emergency", block=True)
    assert res.skipped
    assert (Path(engine.directory) / "step-000000003" / "manifest.json").read_bytes() == before


def test_retention_keeps_last_k_and_every_nth(tmp_path):
    eng = CheckpointEngine(tmp_path, retention=RetentionPolicy(keep_last=2, keep_every=4))
    state = make_state()
    for step in range(1, 10):
        eng.save(step, {"app": state})
    eng.close()
    assert [i.step for i in layout.list_checkpoints(tmp_path)] == [4, 8, 9]


def test_flipped_byte_fails_deep_verify_and_load_falls_back_to_previous(engine):
    state = make_state()
    engine.save(1, {"app": state}, block=True)
    want = snapshot(state)
    bump(state)
    engine.save(2, {"app": state}, block=True)
    shard = Path(engine.directory) / "step-000000002" / "shard-00000.safetensors"
    flip_byte(shard, shard.stat().st_size - 10)
    _, problems = layout.check_checkpoint(shard.parent, deep=True)
    assert [p.file for p in problems] == ["shard-00000.safetensors"]
    fresh = make_state(seed=3)
    with pytest.raises(CheckpointCorruptError, match="shard-00000.safetensors"):
        engine.load({"app": fresh}, step=2)
    with structlog.testing.capture_logs() as logs:
        loaded = engine.load({"app": fresh})
    assert loaded.step == 1 and same(snapshot(fresh), want)
    assert [e["event"] for e in logs if e["event"] == "checkpoint_quarantined"] == ["checkpoint_quarantined"]
    assert (Path(engine.directory) / "step-000000002.corrupt").is_dir()


def test_corrupt_load_leaves_the_target_untouched(engine):
    state = make_state()
    engine.save(1, {"app": state}, block=True)
    shard = Path(engine.directory) / "step-000000001" / "shard-00000.safetensors"
    flip_byte(shard, 5000)
    fresh = make_state(seed=4)
    before = snapshot(fresh)
    with pytest.raises(CheckpointCorruptError):
        engine.load({"app": fresh}, step=1)
    assert same(snapshot(fresh), before)


def test_mismatched_names_or_shapes_list_every_key_and_load_nothing(engine):
    engine.save(1, {"app": make_state(width=32)}, block=True)
    other = make_state(width=48, seed=5)
    before = snapshot(other)
    with pytest.raises(CheckpointMismatchError) as err:
        engine.load({"app": other})
    assert "app.model.0.weight" in err.value.keys and "app.optim.state.2.weight.exp_avg" in err.value.keys
    assert "shape [48, 8] != saved [32, 8]" in str(err.value)
    assert same(snapshot(other), before)
    with pytest.raises(CheckpointMismatchError, match="in the checkpoint but not in the state"):
        engine.load({"app": ModelOptimState(make_state().model)})  # no optimizer


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape.bin", "a/../../b"])
def test_manifest_with_unsafe_path_is_refused(engine, bad):
    state = make_state()
    engine.save(1, {"app": state}, block=True)
    ckpt = Path(engine.directory) / "step-000000001"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][bad] = {"size": 1, "checksum": f"{layout.CHECKSUM_ALGORITHM}:00000000"}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NoCheckpointError, match="not consistent"):
        engine.load({"app": make_state()}, step=1)
    with pytest.raises(NoCheckpointError):  # the only checkpoint is quarantined, nothing is left
        engine.load({"app": make_state()})


def test_symlink_escaping_the_checkpoint_is_refused(engine, tmp_path):
    state = make_state()
    engine.save(1, {"app": state}, block=True)
    ckpt = Path(engine.directory) / "step-000000001"
    outside = tmp_path / "outside.json"
    shutil.copy(ckpt / "rank-00000.json", outside)
    (ckpt / "rank-00000.json").unlink()
    (ckpt / "rank-00000.json").symlink_to(outside)
    _, problems = layout.check_checkpoint(ckpt)
    assert [p.file for p in problems] == ["rank-00000.json"] and "outside the checkpoint" in problems[0].reason
    with pytest.raises(NoCheckpointError, match="outside the checkpoint"):
        engine.load({"app": make_state()}, step=1)


def test_unpicklable_free_state_is_refused_with_its_path(engine):
    with pytest.raises(CheckpointError, match=r"app\.extra.*without pickle"):
        engine.save(1, {"app": {"extra": object()}}, block=True)


def test_rank_state_of_any_rank_can_be_read_back(engine):
    res = engine.save(1, {"app": make_state()}, rank_state={"seed": 11}, block=True)
    assert read_rank_state(res.path, 0) == {"seed": 11}
    with pytest.raises(NoCheckpointError, match="no rank_state for rank 1"):
        read_rank_state(res.path, 1)


# --------------------------------------------------------------------------- disk full


@pytest.fixture
def small_tmpfs(tmp_path):
    yield from mounted_tmpfs(tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}", "8m")


def test_disk_full_during_a_background_save_is_logged_counted_and_training_goes_on(small_tmpfs):
    eng = CheckpointEngine(small_tmpfs / "ckpt", retention=RetentionPolicy(keep_last=5))
    state = make_state(width=4096)  # ~0.6 MiB per checkpoint
    res = eng.save(1, {"app": state}, block=True)
    size = sum(f.stat().st_size for f in Path(res.path).iterdir())
    want = snapshot(state)
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as f:  # leave less room than one checkpoint needs
        free = shutil.disk_usage(small_tmpfs).free
        f.write(b"\0" * (free - size // 2))
    bump(state)
    with structlog.testing.capture_logs() as logs:
        handle = eng.save(2, {"app": state})
        with pytest.raises(CheckpointSaveError, match="No space left"):
            handle.wait()
        failing = eng.save(3, {"app": state})  # an earlier failure does not stop the next save...
        with pytest.raises(CheckpointSaveError, match="No space left"):
            failing.wait()  # ...which fails on its own while the disk is full
    assert [(e["step"], e["kind"]) for e in logs if e["event"] == "checkpoint_save_failed"] == [
        (2, "periodic"),
        (3, "periodic"),
    ]
    assert eng.failed_saves == 2
    assert not list((small_tmpfs / "ckpt").glob("*.partial"))
    assert layout.latest_consistent(small_tmpfs / "ckpt", deep=True).step == 1
    filler.unlink()
    assert eng.save(4, {"app": state}, block=True).step == 4  # space again: saves work
    fresh = make_state(width=4096, seed=9)
    eng.load({"app": fresh}, step=1)
    assert same(snapshot(fresh), want)
    eng.close()


class _BrokenPipe:
    """A log sink whose reader is gone (e.g. the supervisor died holding the rank's stderr)."""

    def write(self, s: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_log_sink_neither_hangs_nor_fails_a_save(tmp_path):
    old = structlog.get_config()
    structlog.configure(
        processors=[structlog.processors.JSONRenderer()],
        logger_factory=structlog.WriteLoggerFactory(file=_BrokenPipe()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    try:
        eng = CheckpointEngine(tmp_path / "ckpt")
        state = make_state()
        # Committing logs checkpoint_committed; the save is still committed and reported.
        assert eng.save(1, {"app": state}).wait(timeout=60).step == 1
        shutil.rmtree(tmp_path / "ckpt")
        (tmp_path / "ckpt").write_text("not a directory")
        # A failing save logs checkpoint_save_failed; its error still reaches the caller.
        with pytest.raises(CheckpointSaveError, match="cannot prepare"):
            eng.save(2, {"app": state}).wait(timeout=60)
        eng.close()  # the failure was raised by its handle: nothing left to raise
    finally:
        structlog.configure(**old)


def _odd_layouts() -> dict[str, torch.Tensor]:
    """Tensors that take every staging path: contiguous (fused copy+checksum where the CPU has
    CRC-32C) and not (transposed, narrowed, conjugate views: copied by torch, then checksummed)."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3 * 65536 // 4 + 77, generator=g)  # several checksum blocks, unaligned end
    z = torch.randn(6, 5, dtype=torch.complex64, generator=g)
    return {
        "big": big,
        "transposed": torch.randn(33, 17, generator=g).t(),
        "narrowed": torch.randn(40, 9, generator=g)[3:30, 2:7],
        "bf16": torch.randn(1001, generator=g).to(torch.bfloat16),
        "mask": torch.rand(999, generator=g) > 0.5,
        "scalar": torch.tensor(123456789, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "conj": z.conj(),
        "f16": torch.randn(4097, generator=g).half(),
    }


def test_fused_staging_writes_the_same_files_as_copy_then_checksum(tmp_path, monkeypatch):
    from ftsup.store import blocksum

    tensors = _odd_layouts()
    paths = {}
    for fused in (True, False):
        if fused and not blocksum.fused_copy_available():
            continue
        monkeypatch.setattr(blocksum, "fused_copy_available", lambda fused=fused: fused)
        with CheckpointEngine(tmp_path / f"fused-{fused}") as eng:
            res = eng.save(1, {"t": dict(tensors)}, block=True)
            assert (res.step, layout.check_checkpoint(res.path, deep=True)[1]) == (1, [])
            back = {
                k: torch.zeros_like(v) if not v.is_conj() else torch.zeros_like(v.resolve_conj())
                for k, v in tensors.items()
            }
            eng.load({"t": back})
        for k, v in tensors.items():
            assert torch.equal(back[k], v.resolve_conj()), k
        paths[fused] = Path(res.path)
    if len(paths) == 2:
        for name in ("shard-00000.safetensors", "shard-00000.crc32"):
            assert (paths[True] / name).read_bytes() == (paths[False] / name).read_bytes(), name


def _spares(root: Path) -> dict[str, int]:
    pool = root / ".recycle"
    return {p.name: p.stat().st_ino for p in pool.iterdir()} if pool.is_dir() else {}


def test_shard_files_of_deleted_checkpoints_are_written_over_by_the_next_save(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointEngine(root, retention=RetentionPolicy(keep_last=1)) as eng:
        big = make_state(width=512)
        first = Path(eng.save(1, {"app": big}, block=True).path) / "shard-00000.safetensors"
        inode = first.stat().st_ino  # the file lives on (in the pool, then in step 3): no reuse by chance
        eng.save(2, {"app": big}, block=True)  # retention moves step 1's shard into the pool
        small = make_state(width=16, seed=2)  # a smaller shard: the longer spare is cut to size
        want = snapshot(small)
        res = eng.save(3, {"app": small}, block=True)
        shard = Path(res.path) / "shard-00000.safetensors"
        assert shard.stat().st_ino == inode  # the spare was claimed, not a new file
        manifest, problems = layout.check_checkpoint(res.path, deep=True)
        assert problems == [] and manifest is not None
        assert shard.stat().st_size == manifest.files["shard-00000.safetensors"].size
        fresh = make_state(width=16, seed=5)
        eng.load({"app": fresh})
        assert same(snapshot(fresh), want)
    assert len(_spares(root)) == 1  # step 2's shard (retention ran once the engine closed)


def test_without_recycling_deleted_checkpoints_leave_nothing_behind(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointEngine(root, retention=RetentionPolicy(keep_last=1), recycle=False) as eng:
        state = make_state()
        for step in (1, 2, 3):
            eng.save(step, {"app": state}, block=True)
    assert sorted(p.name for p in root.iterdir()) == ["step-000000003"]


def test_a_save_says_it_is_in_progress_from_the_call_to_the_commit(tmp_path: Path) -> None:
    """The leader's `step-N.staging` marker from the save call (seen at the `staged` hook, before the write), then the
    `.partial`; none once committed; a stale marker of an older step (a crashed save's) goes with the next save."""
    from ftsup.store import saving

    root = tmp_path / "ckpt"
    root.mkdir()
    saving.mark_staging(root, 1)  # left by a crashed save
    seen: list[list[str]] = []
    eng = CheckpointEngine(root, hook=lambda point, step: seen.append(sorted(saving.in_progress(root))))
    try:
        eng.save(3, {"app": make_state()}).wait()
    finally:
        eng.close()
    assert "step-000000003.staging" in seen[0]
    assert saving.in_progress(root) == []
