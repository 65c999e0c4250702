"""`ftsup.store.torchzip`: a `torch.save` file read without torch and without running its pickle."""

from __future__ import annotations

import os

import pytest
import torch

from ftsup.store.errors import CheckpointCorruptError
from ftsup.store.torchzip import Archive, Stub, TensorRef


class Planted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_each_tensor_is_a_reference_whose_bytes_are_the_tensors(tmp_path):
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    torch.save({"a": t, "b": t[1], "n": 3, "s": torch.Size([2, 3])}, tmp_path / "f.pt")
    with Archive(tmp_path / "f.pt") as a:
        tree = a.tree()
        assert (type(tree["a"]), tree["b"].offset, tree["n"], tree["s"]) == (TensorRef, 6, 3, (2, 3))
        assert (a.read(tree["a"]), a.read(tree["b"])) == (t.numpy().tobytes(), t[1].numpy().tobytes())


def test_a_global_the_pickle_names_is_never_called(tmp_path):
    torch.save({"x": Planted(str(tmp_path / "ran"))}, tmp_path / "f.pt")
    with Archive(tmp_path / "f.pt") as a:
        got = a.tree()["x"]
    assert (isinstance(got, Stub), got.qualname, (tmp_path / "ran").exists()) == (True, "posix.system", False)


def test_a_file_cut_short_is_refused_naming_it(tmp_path):
    torch.save({"a": torch.zeros(1000)}, tmp_path / "f.pt")
    os.truncate(tmp_path / "f.pt", (tmp_path / "f.pt").stat().st_size - 30)
    with pytest.raises(CheckpointCorruptError, match=r"f\.pt: not a whole torch\.save archive"):
        Archive(tmp_path / "f.pt")


def test_a_link_is_not_followed(tmp_path):
    torch.save({"a": torch.zeros(3)}, tmp_path / "f.pt")
    (tmp_path / "l.pt").symlink_to(tmp_path / "f.pt")
    with pytest.raises(CheckpointCorruptError):
        Archive(tmp_path / "l.pt")
