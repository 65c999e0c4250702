"""The one dtype table (`codec.DTYPES`): every dtype that torch and safetensors both have
round-trips bit for bit through save, load and the Hugging Face export, shard headers agree
with safetensors' own writer, and a dtype the format lacks is refused naming the tensor.

One process, no torch.distributed; each tensor is a few bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ftsup.trainer.checkpoint import CheckpointEngine, CheckpointError, codec
from ftsup.trainer.hf.export import export_hf

# Every dtype torch 2.13 and safetensors 0.8 both support, written out (not read from the table
# under test, so that a dtype dropped from the table fails here).
BOTH = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "complex64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]
SHAPE = (3, 5)


def sample(name: str, seed: int = 0) -> torch.Tensor:
    """A tensor of dtype `name` made of arbitrary bytes (bool: 0 or 1, its only valid bytes)."""
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (SHAPE[0], SHAPE[1] * dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def save_one(root: Path, t: torch.Tensor) -> None:
    with CheckpointEngine(root, check_finite=False) as eng:  # arbitrary bytes: NaN patterns included
        eng.save(1, {"app": {"model": {"w": t.clone()}}}, block=True)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("name", BOTH)
def test_a_tensor_of_each_dtype_loads_back_bit_for_bit(tmp_path, name, transposed):
    # A transposed tensor takes torch's copy on both sides instead of the fused byte copy.
    t = sample(name).t() if transposed else sample(name)
    save_one(tmp_path / "ckpt", t)
    into = {"app": {"model": {"w": sample(name, seed=1).t() if transposed else sample(name, seed=1)}}}
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        eng.load(into)
    got = into["app"]["model"]["w"]
    assert (got.dtype, as_bytes(got)) == (t.dtype, as_bytes(t))


@pytest.mark.parametrize("name", BOTH)
def test_a_tensor_of_each_dtype_exports_to_what_safetensors_loads_bit_for_bit(tmp_path, name):
    t = sample(name)
    save_one(tmp_path / "ckpt", t)
    index = export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    got = load_file(tmp_path / "hf" / index["weight_map"]["w"])["w"]
    assert (got.dtype, got.shape, as_bytes(got)) == (t.dtype, t.shape, as_bytes(t))


@pytest.mark.parametrize("name", BOTH)
def test_the_tables_safetensors_header_is_what_safetensors_writes(tmp_path, name):
    t = sample(name)
    save_file({"w": t}, tmp_path / "ref.safetensors")
    theirs = header(tmp_path / "ref.safetensors")["w"]
    assert codec.safetensors_header(t.dtype, list(t.shape), "w") == (theirs["dtype"], theirs["shape"])


def test_a_shard_holding_every_dtype_opens_in_safetensors_with_each_chunks_dtype(tmp_path):
    state = {name: sample(name, seed=i) for i, name in enumerate([*BOTH, "complex128"])}
    with CheckpointEngine(tmp_path / "ckpt", check_finite=False) as eng:  # arbitrary bytes: NaN patterns included
        res = eng.save(1, {"app": dict(state)}, block=True)
    with safe_open(str(Path(res.path) / "shard-00000.safetensors"), framework="pt") as f:
        got = {k.split("@")[0].removeprefix("app."): f.get_tensor(k) for k in f.keys()}
    # complex128, which safetensors lacks, is kept as its raw bytes (the checkpoint's metadata has the dtype)
    want = {n: (t.dtype, as_bytes(t)) for n, t in state.items()} | {
        "complex128": (torch.uint8, as_bytes(state["complex128"]))
    }
    assert {n: (t.dtype, as_bytes(t)) for n, t in got.items()} == want


def test_a_complex128_tensor_round_trips_through_the_checkpoint(tmp_path):
    t = torch.randn(SHAPE, dtype=torch.complex128)
    save_one(tmp_path / "ckpt", t)
    into = {"app": {"model": {"w": torch.zeros(SHAPE, dtype=torch.complex128)}}}
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        eng.load(into)
    assert as_bytes(into["app"]["model"]["w"]) == as_bytes(t)


def test_exporting_a_dtype_safetensors_lacks_names_the_tensor_and_leaves_no_output(tmp_path):
    save_one(tmp_path / "ckpt", torch.randn(SHAPE, dtype=torch.complex128))
    with pytest.raises(CheckpointError, match=r"tensor 'w' has dtype complex128, which safetensors cannot store"):
        export_hf(tmp_path / "ckpt", 1, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("name", ["bits16", "complex32", "uint4"])
def test_saving_a_dtype_the_format_lacks_names_the_tensor_and_commits_nothing(tmp_path, name):
    t = torch.zeros(8, dtype=torch.uint8).view(getattr(torch, name))
    with CheckpointEngine(tmp_path / "ckpt") as eng:
        with pytest.raises(CheckpointError, match=rf"app\.model\.w: tensor dtype torch\.{name} is not supported"):
            eng.save(1, {"app": {"model": {"w": t}}}, block=True)
    assert list(tmp_path.glob("ckpt/step-*")) == []


def test_rank_state_of_a_dtype_the_format_lacks_names_where_it_is():
    with pytest.raises(CheckpointError, match=r"rank_state at rng\.state: tensor dtype torch\.bits8"):
        codec.encode_inline({"rng": {"state": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)}})
