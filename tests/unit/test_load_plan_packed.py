"""The load's plan at thousands of ranks (`loadplan`): rank 0's checked DCP metadata packed by tensor, each rank's
reader over its own tensors' chunks only, planning exactly the reads the whole metadata plans."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from ftsup.store import dcpmeta, dtypes, layout
from ftsup.store.errors import CheckpointCorruptError
from ftsup.tools.bench.scale import ops as scale_ops
from ftsup.tools.bench.scale.state import Job, Model
from ftsup.trainer.checkpoint import loadplan
from ftsup.trainer.checkpoint.reader import ShardReader

MODEL = Model(layers=3, hidden=24, ffn=40, vocab=56)


def _saved(tmp_path: Path, world: int, pp: int) -> tuple[Job, Path]:
    """A consistent checkpoint of the simulated job (`ftsup bench scale`'s): real metadata, sparse files."""
    job = Job(MODEL, world, pp)
    planned = scale_ops.save_plan_first(job)
    scale_ops.commit(tmp_path, job, planned, 1, files=True)
    return job, tmp_path / layout.step_dirname(1)


@pytest.mark.parametrize(("saved", "loading", "pp"), [(8, 4, 2), (8, 6, 2), (6, 9, 3), (4, 4, 1)])
def test_a_rank_s_packed_share_plans_the_reads_the_whole_metadata_plans(
    tmp_path: Path, saved: int, loading: int, pp: int
) -> None:
    job, path = _saved(tmp_path, saved, pp)
    manifest = layout.read_manifest(path)
    meta = dcpmeta.read(path, manifest)
    packed = pickle.loads(pickle.dumps(loadplan.pack(meta)))  # what crosses ranks
    assert "storage" not in packed and all("chunks" not in t for t in packed["tensors"].values())
    target = Job(MODEL, loading, pp)
    comm = scale_ops.SimComm(loading)
    for rank in range(loading):
        flat = target.rank_state(rank)
        whole = ShardReader(path, manifest, meta, comm)  # type: ignore[arg-type]
        mine = ShardReader(path, manifest, packed, comm, names=flat)  # type: ignore[arg-type]
        assert set(mine.metadata.state_dict_metadata) == set(flat)
        if pp > 1:
            assert len(mine.locs) < len(whole.locs)
        want = scale_ops._load_planner(flat, whole.metadata, rank == 0).create_local_plan().items
        got = scale_ops._load_planner(flat, mine.metadata, rank == 0).create_local_plan().items
        assert got == want and got
        assert [mine.locs[r.storage_index] for r in got] == [whole.locs[r.storage_index] for r in want]


def test_all_tensors_are_unpacked_when_no_names_are_given(tmp_path: Path) -> None:
    _, path = _saved(tmp_path, 4, 2)
    manifest = layout.read_manifest(path)
    meta = dcpmeta.read(path, manifest)
    comm = scale_ops.SimComm(4)
    whole = ShardReader(path, manifest, meta, comm)  # type: ignore[arg-type]
    packed = ShardReader(path, manifest, loadplan.pack(meta), comm)  # type: ignore[arg-type]
    assert packed.locs == whole.locs
    assert packed.metadata.state_dict_metadata == whole.metadata.state_dict_metadata


def test_a_packed_chunk_naming_a_file_outside_the_manifest_is_corrupt(tmp_path: Path) -> None:
    job, path = _saved(tmp_path, 4, 2)
    manifest = layout.read_manifest(path)
    packed = loadplan.pack(dcpmeta.read(path, manifest))
    fqn = next(iter(job.rank_state(0)))
    rows = pickle.loads(packed["chunks"][fqn])
    rows[0] = (*rows[0][:2], "shard-99999.safetensors", *rows[0][3:])
    packed["chunks"][fqn] = pickle.dumps(rows)
    with pytest.raises(CheckpointCorruptError, match="absent from the manifest"):
        ShardReader(path, manifest, packed, scale_ops.SimComm(4), names=[fqn])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t, s: t["chunks"][0].__setitem__("offsets", [-1, 0]), r"chunks\[0\]\.offsets holds -1, not an"),
        (lambda t, s: t["chunks"][0].__setitem__("sizes", [1.5, 0]), r"chunks\[0\]\.sizes holds 1\.5, not an"),
        (lambda t, s: t["chunks"][0].__setitem__("sizes", [1, 2, 3]), r"chunks\[0\]\.sizes has 3 dimensions, not 2"),
        (lambda t, s: t["chunks"][0].pop("sizes"), r"chunks\[0\] has no 'sizes'"),
        (lambda t, s: s.__setitem__("offsets", "x"), r"storage\[0\]\.offsets is not a list"),
        (lambda t, s: s.__setitem__("file", "../x"), r"storage\[0\]\.file"),
        (lambda t, s: s.__setitem__("crc_file", "no-such.crc32"), r"storage\[0\]\.crc_file 'no-such.crc32' is not a"),
    ],
)
def test_the_metadata_check_names_what_is_wrong_in_a_chunk(tmp_path: Path, edit: Any, message: str) -> None:
    _, path = _saved(tmp_path, 4, 2)
    manifest = layout.read_manifest(path)
    meta = dcpmeta.read(path, manifest)
    first = meta["storage"][0]
    edit(meta["tensors"][first["fqn"]], first)
    with pytest.raises(CheckpointCorruptError, match=message):
        dcpmeta.validate(meta, manifest, lambda name: dtypes.lookup(name).itemsize, "here")
