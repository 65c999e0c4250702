"""A directory written by `torch.distributed.checkpoint.save`, read torch-free (`ftsup.store.dcpdir`, `ftsup ckpt
show`): its metadata without a byte of tensor data, torchtitan's `step-N` folders, and hostile input (a truncated or
malicious `.metadata`, a missing or short data file, chunks that overlap) refused naming the file."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftsup.store import dcpdir
from ftsup.store.errors import ModelFileError
from ftsup.supervisor.cli.commands import main


def state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(6, 4), "b": torch.randn(4).to(torch.bfloat16), "n": torch.tensor(3)},
        "step": 7,
    }


def save(path: Path) -> dict[str, Any]:
    sd = state()
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def show(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["ckpt", "show", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_show_lists_every_tensor_of_a_dcp_directory_from_its_metadata_alone(tmp_path, capsys):
    save(tmp_path / "d")
    data = tmp_path / "d" / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))  # no tensor byte is read: zeros in their place change nothing
    code, out, _ = show(capsys, str(tmp_path / "d"), "--json")
    got = json.loads(out)
    rows = {t["name"]: (t["dtype"], t["shape"], t["bytes"], t["files"]) for t in got["tensors"]}
    assert (code, got["layout"], rows, [v["name"] for v in got["values"]]) == (
        0,
        "dcp",
        {
            "model.w": ("float32", [6, 4], 96, ["__0_0.distcp"]),
            "model.b": ("bfloat16", [4], 8, ["__0_0.distcp"]),
            "model.n": ("int64", [], 8, ["__0_0.distcp"]),
        },
        ["step"],
    )


def test_a_torchtitan_folder_of_steps_gives_the_newest_or_the_step_asked_for(tmp_path, capsys):
    save(tmp_path / "t" / "step-3")
    save(tmp_path / "t" / "step-10")
    (tmp_path / "t" / "step-20").mkdir()  # no .metadata: not a checkpoint
    newest = json.loads(show(capsys, str(tmp_path / "t"), "--json")[1])
    asked = json.loads(show(capsys, str(tmp_path / "t"), "--step", "3", "--json")[1])
    code, _, err = show(capsys, str(tmp_path / "t"), "--step", "4")
    assert (newest["step"], asked["step"], code) == (10, 3, 2)
    assert "no DCP checkpoint of step 4 (step-4/.metadata; steps: 3, 10)" in err


def test_a_truncated_metadata_is_refused_naming_it(tmp_path):
    save(tmp_path / "d")
    meta = tmp_path / "d" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-40])
    with pytest.raises(ModelFileError, match=r"d/\.metadata: truncated or not a pickle"):
        dcpdir.read(tmp_path / "d")


def test_a_missing_data_file_is_refused_naming_it(tmp_path, capsys):
    save(tmp_path / "d")
    (tmp_path / "d" / "__0_0.distcp").unlink()
    code, _, err = show(capsys, str(tmp_path / "d"))
    assert (code, "d/__0_0.distcp (named by" in err, err.rstrip().endswith("missing")) == (2, True, True), err


def test_a_data_file_cut_short_is_refused_naming_it_and_the_tensor(tmp_path):
    save(tmp_path / "d")
    data = tmp_path / "d" / "__0_0.distcp"
    os.truncate(data, data.stat().st_size - 100)
    with pytest.raises(ModelFileError, match=r"d/__0_0\.distcp: \d+ bytes, but .* puts '[^']+' up to byte \d+: cut"):
        dcpdir.read(tmp_path / "d")


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("payload", [_Evil(), {"x": eval}], ids=["os.system", "builtins.eval"])
def test_a_metadata_pickle_that_imports_anything_else_is_refused_and_nothing_runs(tmp_path, monkeypatch, payload):
    save(tmp_path / "d")
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(payload))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelFileError, match=r"d/\.metadata: names (posix\.system|builtins\.eval), which is not one"):
        dcpdir.read(tmp_path / "d")
    assert not (tmp_path / "pwned").exists()


def rewrite_metadata(path: Path, change: Any) -> None:
    """Change the metadata (unpickled here, in the test, from a file it wrote) and write it back."""
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the test's own file
    change(meta)
    buf = io.BytesIO()
    pickle.dump(meta, buf)
    (path / ".metadata").write_bytes(buf.getvalue())


def test_a_storage_range_past_the_end_of_its_file_is_refused_naming_the_file(tmp_path):
    save(tmp_path / "d")

    def past_end(meta: Any) -> None:
        for info in meta.storage_data.values():
            info.offset += 1 << 30

    rewrite_metadata(tmp_path / "d", past_end)
    with pytest.raises(ModelFileError, match=r"d/__0_0\.distcp: \d+ bytes, but .* up to byte \d+: cut short"):
        dcpdir.read(tmp_path / "d")


def test_chunks_that_overlap_are_refused_naming_the_tensor(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    save(tmp_path / "d")

    def overlap(meta: Any) -> None:
        t = meta.state_dict_metadata["model.w"]
        t.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4])), *t.chunks]

    rewrite_metadata(tmp_path / "d", overlap)
    with pytest.raises(ModelFileError, match=r"\.metadata: 'model\.w': its chunks do not add up to its size"):
        dcpdir.read(tmp_path / "d")
