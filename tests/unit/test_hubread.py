"""Ranged reads of a Hub-layout model (`ftsup.trainer.hf.hubread.HubReader`): tensors at any offset read
bitwise in pieces whatever piece boundary they cross, with O_DIRECT into the caller's memory and through the page
cache; a piece that comes back short is an error naming the file and the tensor; the process's reading threads
serve readers in several threads at once, are made anew in a forked child, and stop when released."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ftsup.store import hublayout
from ftsup.store.errors import ModelFileError
from ftsup.trainer.checkpoint.shardio import PAGE
from ftsup.trainer.hf import hubread
from ftsup.trainer.hf.hubread import HubReader

ODD_PIECE = 3 * PAGE + 5  # a piece that starts and ends inside pages, its boundaries nowhere near a tensor's


def model_dir(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """One safetensors file whose tensors start at odd offsets (a byte tensor of odd length before each) and span
    many pieces of ODD_PIECE bytes; its tensors."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "a_pad": torch.randint(0, 256, (7,), dtype=torch.uint8, generator=g),
        "b_rows": torch.randint(0, 256, (61, 1021), dtype=torch.uint8, generator=g),  # 5 pieces and a bit
        "c_pad": torch.randint(0, 256, (3,), dtype=torch.uint8, generator=g),
        "d_float": torch.randn(97, 131, generator=g),  # 4 pieces and a bit; safetensors puts it first
        "e_small": torch.randint(0, 256, (5, 9), dtype=torch.uint8, generator=g),
    }
    path.mkdir()
    save_file(sd, str(path / "model.safetensors"))
    return sd


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def odd_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hubread, "PIECE_BYTES", ODD_PIECE)


def test_tensors_across_piece_boundaries_come_back_bitwise_both_ways(tmp_path: Path, odd_pieces: None) -> None:
    sd = model_dir(tmp_path / "hf")
    hub = hublayout.read(tmp_path / "hf")
    starts = {name: hub.tensors[name].start for name in sd}
    assert any(s % PAGE for s in starts.values()), starts  # the tensors do not start on pages
    with HubReader(hub) as reader:
        for name, t in sd.items():
            assert as_bytes(reader.read(name)) == as_bytes(t), name  # through the page cache
            out = torch.zeros(t.nbytes, dtype=torch.uint8)
            assert as_bytes(reader.read(name, out)) == as_bytes(t), name  # O_DIRECT into `out`
            assert out.numpy().tobytes() == as_bytes(t), name
        # rows of a tensor whose range starts and ends inside pieces and pages
        for lo, hi in [(0, 1), (3, 58), (17, 61), (60, 61)]:
            want = as_bytes(sd["b_rows"][lo:hi])
            out = torch.zeros(len(want), dtype=torch.uint8)
            assert as_bytes(reader.read_rows("b_rows", lo, hi, out)) == want, (lo, hi)
            assert as_bytes(reader.read_rows("b_rows", lo, hi)) == want, (lo, hi)
        assert reader.bytes_read >= 2 * sum(t.nbytes for t in sd.values())


def test_many_parts_read_at_once_each_get_exactly_their_rows(tmp_path: Path, odd_pieces: None) -> None:
    sd = model_dir(tmp_path / "hf")
    parts = [("b_rows", 0, 30), ("b_rows", 30, 61), ("d_float", 5, 96), ("e_small", 0, 5), ("a_pad", 2, 7)]
    outs = [torch.full((sd[n][lo:hi].nbytes,), 0xA5, dtype=torch.uint8) for n, lo, hi in parts]
    with HubReader(hublayout.read(tmp_path / "hf")) as reader:
        reader.read_rows_into([(n, lo, hi, out) for (n, lo, hi), out in zip(parts, outs, strict=True)])
    for (n, lo, hi), out in zip(parts, outs, strict=True):
        assert out.numpy().tobytes() == as_bytes(sd[n][lo:hi]), (n, lo, hi)


def test_a_larger_piece_after_smaller_ones_gets_a_buffer_big_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = model_dir(tmp_path / "hf")
    t = sd["b_rows"]
    with HubReader(hublayout.read(tmp_path / "hf")) as reader:
        for piece in (ODD_PIECE, 8 * ODD_PIECE, 64 << 10):  # the reading threads' buffers were made for the first
            monkeypatch.setattr(hubread, "PIECE_BYTES", piece)
            outs = [torch.zeros(t.nbytes, dtype=torch.uint8) for _ in range(3)]
            reader.read_rows_into([("b_rows", 0, t.shape[0], out) for out in outs])
            assert all(out.numpy().tobytes() == as_bytes(t) for out in outs), piece


@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "page-cache"])
def test_a_piece_that_comes_back_short_names_the_file_and_the_tensor(
    tmp_path: Path, odd_pieces: None, direct: bool
) -> None:
    sd = model_dir(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    hub = hublayout.read(tmp_path / "hf")
    entry = hub.tensors["b_rows"]
    with HubReader(hub) as reader:
        reader.read_rows("e_small", 0, 1)  # the file is open (and its size checked) from here on
        with open(path, "r+b") as f:
            f.truncate(entry.start + 5 * ODD_PIECE + 11)  # inside the sixth piece of b_rows
        out = torch.zeros(sd["b_rows"].nbytes, dtype=torch.uint8) if direct else None
        with pytest.raises(ModelFileError, match=r"hf/model\.safetensors: ends inside tensor 'b_rows'"):
            reader.read("b_rows", out)
        parts = [(n, 0, sd[n].shape[0], torch.zeros(sd[n].nbytes, dtype=torch.uint8)) for n in sd]  # d_float first
        with pytest.raises(ModelFileError, match=r"hf/model\.safetensors: ends inside tensor '(b_rows|c_pad|e_small)'"):
            reader.read_rows_into(parts)


def test_readers_in_several_threads_share_the_reading_threads(tmp_path: Path, odd_pieces: None) -> None:
    models = {i: model_dir(tmp_path / f"hf{i}", seed=i) for i in range(3)}
    got: dict[int, bool] = {}

    def load(i: int) -> None:
        sd = models[i]
        with HubReader(hublayout.read(tmp_path / f"hf{i}")) as reader:
            ok = True
            for _ in range(4):
                outs = {n: torch.zeros(t.nbytes, dtype=torch.uint8) for n, t in sd.items()}
                reader.read_rows_into([(n, 0, t.shape[0], outs[n]) for n, t in sd.items()])
                ok = ok and all(outs[n].numpy().tobytes() == as_bytes(t) for n, t in sd.items())
        got[i] = ok

    threads = [threading.Thread(target=load, args=(i,)) for i in models]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert got == dict.fromkeys(models, True)


def _child_reads(directory: str, result: str) -> None:
    hub = hublayout.read(Path(directory))
    with HubReader(hub) as reader:
        out = torch.frombuffer(bytearray(hub.tensors["b_rows"].nbytes), dtype=torch.uint8)  # no torch kernel: the
        Path(result).write_bytes(as_bytes(reader.read("b_rows", out)))  # parent's intra-op threads are not here


def test_a_forked_child_reads_with_threads_of_its_own(tmp_path: Path, odd_pieces: None) -> None:
    sd = model_dir(tmp_path / "hf")
    with HubReader(hublayout.read(tmp_path / "hf")) as reader:  # the parent's reading threads exist, idle
        reader.read("b_rows", torch.zeros(sd["b_rows"].nbytes, dtype=torch.uint8))
    child = multiprocessing.get_context("fork").Process(
        target=_child_reads, args=(str(tmp_path / "hf"), str(tmp_path / "got"))
    )
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child's read never finished: it waited for the parent's reading threads")
    assert child.exitcode == 0
    assert (tmp_path / "got").read_bytes() == as_bytes(sd["b_rows"])


def test_released_reading_threads_stop_and_the_next_read_makes_new_ones(tmp_path: Path, odd_pieces: None) -> None:
    sd = model_dir(tmp_path / "hf")
    t = sd["b_rows"]

    def reading_threads() -> list[threading.Thread]:
        return [th for th in threading.enumerate() if th.name.startswith("ftsup-hub-read")]

    with HubReader(hublayout.read(tmp_path / "hf")) as reader:
        reader.read("b_rows", torch.zeros(t.nbytes, dtype=torch.uint8))  # several pieces: the threads start
        assert reading_threads()
        hubread.release_reading_threads()
        assert reading_threads() == []  # joined, not left to finish
        out = torch.zeros(t.nbytes, dtype=torch.uint8)
        assert as_bytes(reader.read("b_rows", out)) == as_bytes(t)
        assert reading_threads()
    hubread.release_reading_threads()
